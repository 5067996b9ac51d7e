"""Fair-share step scheduler: per-model queues in seq_id order, token-budget packing,
weighted fair sharing between tenants, quotas and backpressure. Standard library only."""
