"""`Engine.check`: the shared rules (`checks.py`) over the engine's own request types.

In local mode (twinkle_sdk in-process) requests may carry tensors and Python callables; they
are turned into plain sequences and checked by the same rules the daemon applies at its
door. Plus what only the engine knows: whether the adapter exists.
"""

from __future__ import annotations

from collections.abc import Sequence

from twinkled.protocol import checks
from twinkled.protocol.types import EngineInputError, ForwardBackwardRequest, SampleRequest

from .lora import LoraPool
from .model import BaseModel


def limits_of(model: BaseModel, pool: LoraPool) -> checks.Limits:
    return checks.Limits(vocab_size=model.vocab_size, max_seq_len=model.max_seq_len,
                         max_rank=pool.max_rank)


def check_forward_backward(req: ForwardBackwardRequest, model: BaseModel, pool: LoraPool) -> None:
    if req.adapter_id is None:
        if not req.forward_only:
            raise EngineInputError("adapter_id", "the base model cannot be trained; pass an adapter")
    else:
        pool.get(req.adapter_id)
    if not req.data:
        raise EngineInputError("data", "no datums")
    loss_fn = None if callable(req.loss_fn) else req.loss_fn
    if loss_fn is not None:
        checks.check_loss(loss_fn, req.loss_config)
    limits = limits_of(model, pool)
    for j, d in enumerate(req.data):
        tokens = _flat(f"data[{j}].model_input", d.tokens)
        inputs = {name: _shaped(f"data[{j}].loss_fn_inputs.{name}", v)
                  for name, v in d.loss_inputs.items()}
        checks.check_datum(j, tokens, inputs, loss_fn, limits)


def check_sample(req: SampleRequest, model: BaseModel, pool: LoraPool) -> None:
    if req.adapter_id is not None:
        pool.get(req.adapter_id)
    p = req.params
    for name, value in (("num_samples", req.num_samples),
                        ("sampling_params.max_tokens", p.max_tokens)):
        if type(value) is not int:
            raise EngineInputError(name, f"must be an integer, got {value!r}")
    checks.check_knobs(p.temperature, p.top_p, p.top_k)
    if req.images and model.vision is None:
        raise EngineInputError("prompt", "images in a prompt of a text-only model")
    checks.check_sample(_flat("prompt", req.prompt), p.max_tokens, req.num_samples,
                        p.stop, limits_of(model, pool))


def _flat(field: str, value) -> list:
    """A 1-D sequence of numbers as a list (tensors are read to the host)."""
    shape, values = _shaped(field, value)
    if len(shape) != 1:
        raise EngineInputError(field, f"must be a 1-D list, got shape {list(shape)}")
    return values


def _shaped(field: str, value) -> tuple[Sequence[int], list]:
    if hasattr(value, "tolist") and hasattr(value, "shape"):  # a tensor or an ndarray
        return list(value.shape), value.reshape(-1).tolist()
    if not isinstance(value, (list, tuple)):
        raise EngineInputError(field, f"must be a list of numbers, got {type(value).__name__}")
    if any(isinstance(v, (list, tuple)) for v in value):
        raise EngineInputError(field, "must be a flat list of numbers")
    return [len(value)], list(value)
