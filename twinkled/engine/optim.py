"""Per-adapter optimizer steps: AdamW, or Dimuon (`dimuon.py`), as each adapter was created.

torch.optim.AdamW wants leaf parameters; an adapter's weights are slices of shared banks
(so that a mixed batch gathers them in one op), so we call torch's functional AdamW on the
slices. Hyperparameters come with every step (Tinker's AdamParams / DimuonParams) and may
change.
"""

from __future__ import annotations

import math

import torch
from msgspec.structs import astuple
from torch.optim.adamw import adamw

from twinkled.protocol.checks import check_adam_params  # noqa: F401 - re-exported for the engine
from twinkled.protocol.types import AdamParams, DimuonParams, OptimResult

from .dimuon import dimuon_update
from .lora import Adapter


def _counters(adapter: Adapter) -> list[torch.Tensor]:
    """The adapter's AdamW step counter, as torch's AdamW keeps it (kept between steps):
    one for the adapter's whole flat state (`Bank.flat`). Read before the step: the
    adapter's `steps` already counts the one being taken.

    Fused AdamW (CUDA) wants it on the device; the CPU path reads it on the host.
    """
    if len(adapter.counters) != 1:
        dev = adapter.bank.device
        where = dev if torch.device(dev).type == "cuda" else "cpu"
        adapter.counters = [torch.tensor(float(adapter.steps), device=where)]
    return adapter.counters


@torch.no_grad()
def optimizer_steps(items: list[tuple[Adapter, AdamParams | DimuonParams]],
                    shard=None) -> list[OptimResult]:
    """Apply each adapter's optimizer to its gradients accumulated since its last step;
    clear them. The params' family is the adapter's (checked by the engine).

    Adapters stepping together share the work: one norm pass and one host sync for all,
    one fused AdamW call per distinct set of AdamW hyperparameters, and one Dimuon call for
    all Dimuon adapters. `shard` (tp.py): the banks hold tensor-parallel slices, so norms
    are of the whole adapter, summed over the group.
    """
    results: list[OptimResult | None] = [None] * len(items)
    live = []
    for i, (adapter, params) in enumerate(items):
        if adapter.pending == 0:
            results[i] = OptimResult(False, {"skipped:sum": 1.0, "reason": "no pending gradients"})
        else:
            live.append((i, adapter, params))
    if not live:
        return results
    # Each adapter's gradients are one flat tensor (Bank.flat): its norm is one norm.
    grads = [a.bank.flat(a.slot, "g") for _, a, _ in live]
    if shard is not None:  # slices of each adapter: norms are summed over the group
        keys = [[f"{p}:{k}" for p in "AB" for k in a.bank.shapes] for _, a, _ in live]
        norms = shard.grad_norms([a.bank.tensors(a.slot, "g") for _, a, _ in live], keys)
    else:
        norms = torch.stack(torch._foreach_norm(grads)).tolist()

    groups: dict[tuple, list] = {}
    dimuon: list[tuple[Adapter, DimuonParams]] = []
    for (i, adapter, params), g, norm in zip(live, grads, norms, strict=True):
        if not math.isfinite(norm):
            # Never let a non-finite gradient into the weights: drop it and say so.
            results[i] = OptimResult(False, {"grad_norm:mean": norm, "skipped:sum": 1.0,
                                             "reason": "non-finite gradient norm; gradients dropped"})
            continue
        # Both families clip the same way; Dimuon's "nonpositive" values mean no clipping.
        if params.grad_clip_norm > 0 and norm > params.grad_clip_norm:
            g.mul_(params.grad_clip_norm / (norm + 1e-6))
        if isinstance(params, DimuonParams):
            dimuon.append((adapter, params))
        else:
            groups.setdefault(astuple(params), []).append(adapter)
            _counters(adapter)  # made before `steps` moves on; AdamW advances them itself
        adapter.steps += 1
        results[i] = OptimResult(True, {"grad_norm:mean": norm,
                                        "learning_rate:mean": params.learning_rate,
                                        "step:max": float(adapter.steps)})
    for key, adapters in groups.items():
        p = AdamParams(*key)
        cat = {kind: [a.bank.flat(a.slot, kind) for a in adapters]
               for kind in ("w", "g", "m", "v")}
        counters = [c for a in adapters for c in _counters(a)]
        fused = cat["w"][0].is_cuda
        adamw(cat["w"], cat["g"], cat["m"], cat["v"], [], counters, foreach=not fused,
              fused=fused, amsgrad=False, beta1=p.beta1, beta2=p.beta2, lr=p.learning_rate,
              weight_decay=p.weight_decay, eps=p.eps, maximize=False)
    if dimuon:
        dimuon_update(dimuon, shard)
    for _, adapter, _ in live:
        adapter.pending = 0
        adapter.bank.changed(adapter.slot)
    torch._foreach_zero_(grads)
    return results
