"""The multi-LoRA engine: one base model, many adapters, shared forward/backward passes."""

from .engine import AdapterInfo, Engine
from .types import (
    AdamParams,
    Datum,
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

__all__ = [
    "AdamParams", "AdapterInfo", "Datum", "Engine", "EngineInputError",
    "ForwardBackwardRequest", "ForwardBackwardResult", "LoraConfig", "OptimResult",
    "SampleRequest", "SampleResult", "SampledSequence", "SamplingParams",
]
