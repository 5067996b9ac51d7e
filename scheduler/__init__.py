"""Fair-share step scheduler: per-model queues in seq_id order, steps packed up to a time
target (a cost model learned from measured steps) and a token budget, weighted fair sharing
of time between tenants, quotas and backpressure. Standard library only."""

from .cost import CostModel, StepShape
from .fairness import Ledger, Limits
from .planner import Planner, Step
from .queues import OPTIM, SAMPLE, TRAIN, Work

__all__ = ["CostModel", "Ledger", "Limits", "OPTIM", "Planner", "SAMPLE", "Step", "StepShape", "TRAIN", "Work"]
