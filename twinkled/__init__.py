"""twinkled: the multi-tenant LoRA training daemon. The engine (torch) lives in
twinkled.engine and is imported only by workers and local mode."""
