"""The losses a model runs by name: the seed documents' class names and Tinker's loss names,
each to the engine's loss (twinkled/engine/losses.py). Local mode also takes a callable."""

from __future__ import annotations

BUILTIN_LOSSES = {
    "CrossEntropyLoss": "cross_entropy", "cross_entropy": "cross_entropy",
    "GRPOLoss": "ppo", "PPOLoss": "ppo", "ppo": "ppo",
    "ImportanceSamplingLoss": "importance_sampling", "importance_sampling": "importance_sampling",
    "CISPOLoss": "cispo", "cispo": "cispo", "DROLoss": "dro", "dro": "dro",
}
