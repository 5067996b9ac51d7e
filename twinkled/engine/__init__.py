"""The multi-LoRA engine: one base model, many adapters, shared forward/backward passes.

`Engine` is imported lazily: the plain types (`twinkled.protocol.types`) are torch-free and
used by the daemon's HTTP process, which must not import torch.
"""

from typing import TYPE_CHECKING

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
