"""Fair-share step scheduler: per-model queues in seq_id order, token-budget packing,
weighted fair sharing between tenants, quotas and backpressure. Standard library only."""

from .fairness import Limits
from .planner import Planner, Step
from .queues import SAMPLE, TRAIN, Work

__all__ = ["Limits", "Planner", "SAMPLE", "Step", "TRAIN", "Work"]
