"""Data parallelism: the ranks of a worker group split a step's rows, then sum gradients.

Tinker's losses are sums over tokens, so the gradient of a batch is the sum of its parts'
gradients: an all-reduce (SUM) before the optimizer step gives every rank exactly what one
rank computing all rows would have, and every rank then takes the same step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .lora import Adapter


def reduce_gradients(adapters: list[Adapter], group: dist.ProcessGroup | None) -> None:
    """Sum the adapters' gradients and pending counts over `group`, in one collective.

    Every rank must call this with the same adapters in the same order (SPMD). A rank that
    ran no rows of an adapter contributes zeros; `pending` becomes the group's total, so the
    step is taken (or skipped) on every rank alike."""
    if not adapters:
        return
    grads = [a.bank.flat(a.slot, "g") for a in adapters]  # one tensor per adapter
    counts = torch.tensor([float(a.pending) for a in adapters], dtype=grads[0].dtype,
                          device=grads[0].device)
    flat = torch.cat([*grads, counts])
    dist.all_reduce(flat, group=group)
    *parts, total = flat.split([g.numel() for g in grads] + [len(adapters)])
    torch._foreach_copy_(grads, parts)
    for a, n in zip(adapters, total.tolist(), strict=True):
        a.pending = round(n)


def split_rows(costs: list[int], world: int) -> list[int]:
    """Assign rows to ranks, largest first to the least-loaded rank; returns each row's rank.

    Deterministic, so every rank computes the same assignment from the same step."""
    load = [0] * world
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += costs[i]
    return owner
