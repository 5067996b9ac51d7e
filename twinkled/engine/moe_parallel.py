"""Expert parallelism: the experts of every MoE layer split across the ranks of a group.

A worker group of N ranks with `ep` E: ranks r and r' with r // E == r' // E form one
expert group (E ranks, each holding 1/E of every layer's experts), and the N / E expert
groups are data-parallel replicas (rows are split between them, workers/runner.py).

Inside an expert group every rank runs the same rows: attention and the other dense parts
are replicated, and each rank computes only the (token, expert) pairs of the experts it
owns, from its local copy of the tokens, so no token has to travel; one all-reduce (sum)
per MoE layer joins the ranks' partial outputs, and in the backward one all-reduce joins
their partial input gradients (megatron's copy-to / reduce-from pair). That is expert
parallelism with all-reduce dispatch rather than all-to-all: it keeps every rank's step
identical (the same micro-batches, the same decode steps), so the collectives can never
fall out of step, and it composes with the row split of data parallelism unchanged. What
it costs is the dense work repeated on the E ranks; all-to-all dispatch of split rows
would not repeat it, and is the next step for large expert groups.

Gradients: an expert's LoRA gradients exist only on the ranks that own it (zeros
elsewhere; the LoRA banks keep every expert so that checkpoints never depend on the split)
and are summed over the whole world; the other LoRA gradients are the same on the ranks
of one expert group and are summed over the data-parallel group (one rank per expert
group), so no row counts twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from twinkled.protocol.types import EngineInputError

from .lora import Adapter
from .moe_peft import is_expert
from .parallel import sum_in_place


@dataclass(frozen=True)
class ExpertSplit:
    """This rank's share of the experts: index `rank` of `size` ranks in `group`."""

    rank: int
    size: int
    group: dist.ProcessGroup | None

    def owned(self, n_experts: int, layer: int) -> slice:
        if n_experts % self.size:
            raise EngineInputError("ep", f"ep={self.size} does not divide the {n_experts} "
                                   f"experts of layer {layer}")
        per = n_experts // self.size
        return slice(self.rank * per, (self.rank + 1) * per)


def expert_groups(rank: int, world: int, ep: int):
    """(ExpertSplit, data-parallel group or None) for this rank; every rank must call it
    (new_group is collective), in the same order."""
    if ep < 1 or world % ep:
        raise EngineInputError("ep", f"ep={ep} does not divide the {world} worker ranks")
    mine = dp = None
    for g in range(world // ep):  # expert groups: consecutive ranks
        group = dist.new_group(list(range(g * ep, (g + 1) * ep)))
        if rank // ep == g:
            mine = group
    for e in range(ep):  # data-parallel groups: one rank of each expert group
        ranks = list(range(e, world, ep))
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank % ep == e:
            dp = group
    return ExpertSplit(rank % ep, ep, mine), dp


class _ReduceFromExperts(torch.autograd.Function):
    """Forward: sum the ranks' partial outputs. Backward: each rank's part gets the whole
    (identical everywhere) output gradient."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _CopyToExperts(torch.autograd.Function):
    """Forward: the replicated input as it is. Backward: sum the ranks' partial gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def copy_to_experts(x: torch.Tensor, split: ExpertSplit) -> torch.Tensor:
    return _CopyToExperts.apply(x, split.group) if torch.is_grad_enabled() else x


def reduce_from_experts(x: torch.Tensor, split: ExpertSplit) -> torch.Tensor:
    if torch.is_grad_enabled():
        return _ReduceFromExperts.apply(x, split.group)
    dist.all_reduce(x, group=split.group)
    return x


def reduce_split_gradients(adapters: list[Adapter], dp_group) -> None:
    """Sum expert LoRA gradients over the world and the rest (and `pending`) over the
    data-parallel group, None when it is this rank alone (see the module's docstring).
    SPMD: every rank passes the same adapters in the same order."""
    if not adapters:
        return
    expert, dense = [], []
    for a in adapters:
        keys = list(a.bank.shapes) * 2  # tensors(): every A, then every B
        for key, g in zip(keys, a.bank.tensors(a.slot, "g"), strict=True):
            (expert if is_expert(key) else dense).append(g)
    counts = torch.tensor([float(a.pending) for a in adapters], device=adapters[0].bank.device)
    sum_in_place(expert, None)  # None: the world
    if dp_group is not None:
        sum_in_place(dense + [counts], dp_group)
    for a, n in zip(adapters, counts.tolist(), strict=True):
        a.pending = round(n)
