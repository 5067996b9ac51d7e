"""Checks run before the engine touches any state, so bad input changes nothing.

Every error names the field (and the datum) at fault. The daemon runs these per request
before co-batching, so one tenant's bad request never fails another's step.
"""

from __future__ import annotations

import math

import torch

from .lora import LoraPool
from .losses import LOSSES, loss_spec
from .model import BaseModel
from .types import Datum, EngineInputError, ForwardBackwardRequest, SampleRequest

_INT_INPUTS = {"target_tokens"}
KNOWN_INPUTS = {n for s in LOSSES.values() for n in s.required + s.optional}


def check_forward_backward(req: ForwardBackwardRequest, model: BaseModel, pool: LoraPool) -> None:
    if req.adapter_id is None:
        if not req.forward_only:
            raise EngineInputError("adapter_id", "the base model cannot be trained; pass an adapter")
    else:
        pool.get(req.adapter_id)
    if not req.data:
        raise EngineInputError("data", "no datums")
    spec = None
    if not callable(req.loss_fn):
        spec = loss_spec(req.loss_fn)
        cfg = req.loss_config or {}
        unknown = set(cfg) - set(spec.config)
        if unknown:
            raise EngineInputError(
                "loss_fn_config", f"{sorted(unknown)} not used by {req.loss_fn!r}"
                f" (accepted: {list(spec.config) or 'none'})")
        for k in spec.required_config:
            if k not in cfg:
                raise EngineInputError(f"loss_fn_config.{k}", f"required by {req.loss_fn!r}")
        for k, v in cfg.items():
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise EngineInputError(f"loss_fn_config.{k}", f"must be a finite number, got {v!r}")
    for j, d in enumerate(req.data):
        _check_datum(j, d, spec, model)


def _check_datum(j: int, d: Datum, spec, model: BaseModel) -> None:
    where = f"data[{j}]"
    tokens = _as_tensor(f"{where}.model_input", d.tokens, torch.long)
    n = tokens.numel()
    if tokens.dim() != 1 or n == 0:
        raise EngineInputError(f"{where}.model_input", "must be a non-empty 1-D token list")
    if n > model.max_seq_len:
        raise EngineInputError(
            f"{where}.model_input", f"length {n} exceeds the model's context of {model.max_seq_len}")
    _check_vocab(f"{where}.model_input", tokens, model.vocab_size)
    if "target_tokens" not in d.loss_inputs:
        raise EngineInputError(f"{where}.loss_fn_inputs.target_tokens", "required")
    for name, value in d.loss_inputs.items():
        field = f"{where}.loss_fn_inputs.{name}"
        # Inputs of other built-in losses are allowed (the same RL datums are often sent to
        # a forward pass); a name no loss knows is most likely a typo.
        if spec is not None and name not in KNOWN_INPUTS:
            raise EngineInputError(field, f"unknown loss input (known: {sorted(KNOWN_INPUTS)})")
        t = _as_tensor(field, value, torch.long if name in _INT_INPUTS else torch.float32)
        if t.dim() != 1 or t.numel() != n:
            raise EngineInputError(
                field, f"has shape {tuple(t.shape)}, but the model input has {n} tokens")
        if name in _INT_INPUTS:
            _check_vocab(field, t, model.vocab_size)
        elif not torch.isfinite(t).all():
            raise EngineInputError(field, "contains NaN or infinite values")
    if spec is not None:
        for name in spec.required:
            if name not in d.loss_inputs:
                raise EngineInputError(f"{where}.loss_fn_inputs.{name}", "required by this loss")


def check_sample(req: SampleRequest, model: BaseModel, pool: LoraPool) -> None:
    if req.adapter_id is not None:
        pool.get(req.adapter_id)
    prompt = _as_tensor("prompt", req.prompt, torch.long)
    if prompt.dim() != 1 or prompt.numel() == 0:
        raise EngineInputError("prompt", "must be a non-empty 1-D token list")
    _check_vocab("prompt", prompt, model.vocab_size)
    p = req.params
    if not isinstance(req.num_samples, int) or req.num_samples < 1:
        raise EngineInputError("num_samples", f"must be >= 1, got {req.num_samples!r}")
    if not isinstance(p.max_tokens, int) or p.max_tokens < 1:
        raise EngineInputError("sampling_params.max_tokens", f"must be >= 1, got {p.max_tokens!r}")
    if prompt.numel() + p.max_tokens > model.max_seq_len:
        raise EngineInputError(
            "sampling_params.max_tokens", f"prompt ({prompt.numel()}) + max_tokens "
            f"({p.max_tokens}) exceeds the model's context of {model.max_seq_len}")
    if not math.isfinite(p.temperature) or p.temperature < 0:
        raise EngineInputError("sampling_params.temperature", "must be >= 0")
    if not 0 < p.top_p <= 1:
        raise EngineInputError("sampling_params.top_p", "must be in (0, 1]")
    if not isinstance(p.top_k, int) or (p.top_k < 1 and p.top_k != -1):
        raise EngineInputError("sampling_params.top_k", "must be -1 (off) or >= 1")
    if p.stop:
        kinds = {type(s) for s in p.stop}
        if kinds not in ({int}, {str}):
            raise EngineInputError("sampling_params.stop", "must be all strings or all token ids")
        if kinds == {int} and any(not 0 <= s < model.vocab_size for s in p.stop):
            raise EngineInputError("sampling_params.stop", "token id outside the vocabulary")


def _as_tensor(field: str, value, dtype) -> torch.Tensor:
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise EngineInputError(field, f"not a numeric array ({e})") from None
    if dtype == torch.long and t.is_floating_point() and t.numel() > 0:
        raise EngineInputError(field, "must hold integers")
    return t


def _check_vocab(field: str, t: torch.Tensor, vocab: int) -> None:
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
        bad = t[(t < 0) | (t >= vocab)][0].item()
        raise EngineInputError(field, f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
