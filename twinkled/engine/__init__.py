"""The multi-LoRA engine: one base model, many adapters, shared forward/backward passes.

`Engine` is imported lazily: the plain types (`twinkled.protocol.types`) are torch-free and
used by the daemon's HTTP process, which must not import torch.
"""

import os
from typing import TYPE_CHECKING

# Triton keeps the configs its autotuning picks on disk (beside its compiled kernels), so a
# restarted worker does not time every config of every kernel again: fla-core's kernels alone
# take ~40 s a set of head sizes on an H200 (measured, session 8). Read when a kernel module
# is imported, hence here, before any is; an operator's own setting wins.
os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")

from twinkled.protocol.types import (
    AdamParams,
    AdapterInfo,
    Datum,
    DimuonParams,
    EngineInputError,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    LoraConfig,
    OptimResult,
    SampledSequence,
    SampleRequest,
    SampleResult,
    SamplingParams,
)

if TYPE_CHECKING:
    from .engine import Engine

__all__ = [
    "AdamParams", "AdapterInfo", "Datum", "DimuonParams", "Engine", "EngineInputError",
    "ForwardBackwardRequest", "ForwardBackwardResult", "LoraConfig", "OptimResult",
    "SampleRequest", "SampleResult", "SampledSequence", "SamplingParams",
]


def __getattr__(name: str):
    if name == "Engine":
        from .engine import Engine

        return Engine
    raise AttributeError(name)
