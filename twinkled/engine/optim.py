"""Per-adapter AdamW over the adapter's slice of its bank.

torch.optim.AdamW wants leaf parameters; an adapter's weights are slices of shared banks
(so that a mixed batch gathers them in one op), so we call torch's functional AdamW on the
slices. Hyperparameters come with every step (Tinker's AdamParams) and may change.
"""

from __future__ import annotations

import math

import torch
from torch.optim.adamw import adamw

from .lora import Adapter
from .types import AdamParams, EngineInputError, OptimResult


def check_adam_params(p: AdamParams) -> None:
    for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
        v = getattr(p, name)
        if not isinstance(v, (int, float)) or not math.isfinite(v):
            raise EngineInputError(f"adam_params.{name}", f"must be a finite number, got {v!r}")
    if p.learning_rate < 0:
        raise EngineInputError("adam_params.learning_rate", "must be >= 0")
    for name in ("beta1", "beta2"):
        if not 0.0 <= getattr(p, name) < 1.0:
            raise EngineInputError(f"adam_params.{name}", "must be in [0, 1)")
    if p.eps < 0 or p.weight_decay < 0 or p.grad_clip_norm < 0:
        raise EngineInputError("adam_params", "eps, weight_decay and grad_clip_norm must be >= 0")


def _counters(adapter: Adapter) -> list[torch.Tensor]:
    """One step counter per weight tensor, as torch's AdamW keeps them (kept between steps).

    Fused AdamW (CUDA) wants them on the device; the CPU path reads them on the host.
    """
    n = 2 * len(adapter.bank.shapes)
    if len(adapter.counters) != n:
        dev = adapter.bank.device
        where = dev if torch.device(dev).type == "cuda" else "cpu"
        adapter.counters = [torch.tensor(float(adapter.steps), device=where) for _ in range(n)]
    return adapter.counters


@torch.no_grad()
def adamw_step(adapter: Adapter, params: AdamParams) -> OptimResult:
    """Apply AdamW to the gradients accumulated since the adapter's last step, then clear them."""
    if adapter.pending == 0:
        return OptimResult(False, {"skipped:sum": 1.0, "reason": "no pending gradients"})
    bank, slot = adapter.bank, adapter.slot
    weights, grads = bank.tensors(slot, "w"), bank.tensors(slot, "g")
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))).item()
    if not math.isfinite(norm):
        # Never let a non-finite gradient into the weights: drop it and say so.
        bank.zero_slot(slot)
        adapter.pending = 0
        return OptimResult(False, {"grad_norm:mean": norm, "skipped:sum": 1.0,
                                   "reason": "non-finite gradient norm; gradients dropped"})
    if params.grad_clip_norm > 0 and norm > params.grad_clip_norm:
        torch._foreach_mul_(grads, params.grad_clip_norm / (norm + 1e-6))
    fused = weights[0].is_cuda
    adamw(weights, grads, bank.tensors(slot, "m"), bank.tensors(slot, "v"), [], _counters(adapter),
          foreach=not fused, fused=fused, amsgrad=False, beta1=params.beta1,
          beta2=params.beta2, lr=params.learning_rate, weight_decay=params.weight_decay,
          eps=params.eps, maximize=False)
    bank.zero_slot(slot)
    adapter.steps += 1
    adapter.pending = 0
    return OptimResult(True, {"grad_norm:mean": norm, "learning_rate:mean": params.learning_rate,
                              "step:max": float(adapter.steps)})
