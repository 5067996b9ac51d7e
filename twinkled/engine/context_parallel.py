"""Context parallelism (issue 38): one long row's tokens split over the ranks of a group.

A row longer than `min_tokens` is cut into 2N chunks of (nearly) equal length; rank i of
the N-rank group holds chunks i and 2N-1-i. Under a causal mask chunk c costs about c + 1
chunks of keys, so each rank holds one cheap and one dear chunk: the same work everywhere
(the load-balanced layout of Megatron's and ring attention's context parallelism).

Each rank runs the row's positions it holds through every layer (their own token
embeddings, true RoPE positions, LoRA deltas, MLPs: all per token). Attention is the one
place a token needs others: per layer the group all-gathers the keys and values of its
chunks (`Gather`, differentiable: the backward sums every rank's gradient of the gathered
keys and hands each rank its own part), and each local chunk attends causally to the row's
keys up to its own end. This is the simplest exact scheme (each rank holds the whole row's
K/V of one layer at a time; ring attention would hold two chunks) and suits rows of up to
a few hundred thousand tokens on an 8B (K/V of 128K tokens of one layer: 256 MB in bf16).

The loss: a datum's loss may couple its tokens (gspo's sequence ratio), so the row's target
logprobs are gathered too and its whole loss is taken on the group's rank 0; the others
take it times zero, which keeps every rank's backward running the same collectives in the
same order (SPMD) and lets the gradient flow back to each rank's own positions. LoRA
gradients then land in each rank's banks and are summed over the lane at the optimizer step
as data parallelism sums them (parallel.py): Tinker's losses are sums over a datum's terms,
so the parts' gradients add up to the whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from .packed import varlen_attend


class ContextParallel:
    """This rank's place in its context-parallel group of `size` consecutive ranks."""

    def __init__(self, size: int, min_tokens: int, group=None):
        self.size, self.min_tokens, self.group = size, min_tokens, group
        self.rank = dist.get_rank(group) if size > 1 else 0

    def splits(self, tokens: int) -> bool:
        """A row of this many tokens is split over the group."""
        return self.size > 1 and tokens > self.min_tokens

    def chunks(self, n: int) -> list[tuple[int, int]]:
        """The 2N chunks (start, end) of a row of n tokens, as equal as can be."""
        edges = np.linspace(0, n, 2 * self.size + 1).round().astype(int)
        return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True)]

    def held(self, rank: int) -> tuple[int, int]:
        """The two chunks `rank` holds: a cheap one and a dear one."""
        return rank, 2 * self.size - 1 - rank

    def gather(self, x: torch.Tensor, sizes: list[int], dim: int) -> torch.Tensor:
        """Every rank's `x` (rank r's has sizes[r] along `dim`) end to end in rank order,
        differentiable."""
        return Gather.apply(x, self.group, sizes, dim)


def cp_groups(rank: int, world: int, size: int) -> ContextParallel | None:
    """Split the world into context-parallel groups of `size` consecutive ranks; every rank
    calls this (new_group is collective). None where size is 1."""
    if size <= 1:
        return None
    if world % size:
        raise ValueError(f"cp {size} does not divide the {world} ranks")
    mine = None
    for start in range(0, world, size):
        g = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = g
    return mine


class Gather(torch.autograd.Function):
    """All-gather of tensors of different lengths along `dim` (padded to the longest for the
    collective). Backward: the sum over ranks of the gradient of the whole, this rank's part
    (an all-reduce, which gloo has; NCCL would do a reduce-scatter in half the bytes)."""

    @staticmethod
    def forward(ctx, x, group, sizes, dim):
        ctx.group, ctx.sizes, ctx.dim = group, sizes, dim
        ctx.rank = dist.get_rank(group)
        longest = max(sizes)
        pad = list(x.shape)
        pad[dim] = longest - x.shape[dim]
        padded = torch.cat([x, x.new_zeros(pad)], dim=dim).contiguous()
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes, strict=True)],
                         dim=dim)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)  # autograd's may be shared
        dist.all_reduce(grad, group=ctx.group)
        start = sum(ctx.sizes[:ctx.rank])
        return grad.narrow(ctx.dim, start, ctx.sizes[ctx.rank]), None, None, None


@dataclass
class CpPacking:
    """A micro-batch of split rows: this rank's chunks of each, end to end (each row's two
    chunks together). Same interface as packed.Packing (`positions`, `attend`,
    `memory_tokens`), so the model's forward runs it as any packed micro-batch."""

    cp: ContextParallel
    sizes: list[int]  # tokens each rank holds of this micro-batch
    local: list[np.ndarray]  # per row: the row positions this rank holds, in packed order
    whole: list[torch.Tensor]  # per row: where each of its positions is in the gathered tokens
    positions: torch.Tensor  # [1, T] this rank's tokens' positions within their rows
    cu_q: torch.Tensor  # each local chunk's queries (chunks end to end, as the tokens are)
    cu_k: torch.Tensor
    keys: torch.Tensor  # gathered index of each chunk's keys: its row's first to its last
    longest_q: int
    longest_k: int

    @staticmethod
    def of(cp: ContextParallel, lengths: list[int], device) -> CpPacking:
        """`lengths`: the whole rows' lengths, in the micro-batch's order (every rank alike)."""
        held = {r: cp.held(r) for r in range(cp.size)}
        chunks = [cp.chunks(n) for n in lengths]
        # Where rank r's chunk c of row j starts in rank r's packed sequence.
        sizes, starts = [], {}
        for r in range(cp.size):
            at = 0
            for j, cs in enumerate(chunks):
                for c in held[r]:
                    starts[r, j, c] = at
                    at += cs[c][1] - cs[c][0]
            sizes.append(at)
        offset = np.cumsum([0, *sizes])
        local, whole, keys, cu_q, cu_k = [], [], [], [0], [0]
        for j, cs in enumerate(chunks):
            index = np.concatenate([
                offset[r] + starts[r, j, c] + np.arange(cs[c][1] - cs[c][0])
                for c in range(2 * cp.size) for r in [c if c < cp.size else 2 * cp.size - 1 - c]])
            whole.append(torch.from_numpy(index).to(device))
            local.append(np.concatenate([np.arange(*cs[c]) for c in held[cp.rank]]))
            for c in held[cp.rank]:
                lo, hi = cs[c]
                keys.append(index[:hi])
                cu_q.append(cu_q[-1] + hi - lo)
                cu_k.append(cu_k[-1] + hi)
        positions = torch.from_numpy(np.concatenate(local)).to(device)[None]
        return CpPacking(cp, sizes, local, whole, positions,
                         *(torch.tensor(c, dtype=torch.int32, device=device) for c in (cu_q, cu_k)),
                         torch.from_numpy(np.concatenate(keys)).to(device),
                         int(np.diff(cu_q).max()), int(np.diff(cu_k).max()))

    def memory_tokens(self) -> int:
        """Tokens a pass keeps for its backward: this rank's, and the gathered keys each
        chunk reads (counted as whole tokens, erring towards recomputing)."""
        return int(self.positions.shape[1]) + int(self.keys.shape[0])

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               gqa: bool) -> torch.Tensor:
        """q [1, H, T, D], k/v [1, Hkv, T, D] (this rank's tokens) -> [1, H, T, D]: each
        chunk's queries over its row's keys up to the chunk's end, gathered from the group
        (keys and values in one collective)."""
        kv = self.cp.gather(torch.cat([k, v], dim=1), self.sizes, dim=2)
        kk, vv = (t.index_select(2, self.keys) for t in kv.chunk(2, dim=1))
        half = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
        # The same segments either way: flash's varlen kernel, or SDPA per chunk.
        kernel = varlen_attend if half else segment_attend
        return kernel(q, kk, vv, self.cu_q, self.cu_k, self.longest_q, self.longest_k, scale,
                      gqa)

    def whole_rows(self, lp: torch.Tensor) -> list[torch.Tensor]:
        """This rank's target logprobs [T, K] -> every row's whole [n, K], gathered from
        the group (differentiable: a row's loss reaches every rank's positions)."""
        every = self.cp.gather(lp, self.sizes, dim=0)
        return [every.index_select(0, w) for w in self.whole]


def segment_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                   cu_k: torch.Tensor, max_q: int, max_k: int, scale: float,
                   gqa: bool) -> torch.Tensor:
    """packed.varlen_attend's semantics in SDPA calls, one per segment (CPUs, fp32):
    segment i's queries over its keys, causal aligned to the keys' end."""
    outs, cq, ck = [], cu_q.tolist(), cu_k.tolist()
    for q0, q1, k0, k1 in zip(cq[:-1], cq[1:], ck[:-1], ck[1:], strict=True):
        n, m = q1 - q0, k1 - k0
        mask = torch.ones((n, m), dtype=torch.bool, device=q.device).tril(m - n)
        outs.append(F.scaled_dot_product_attention(
            q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], attn_mask=mask, scale=scale,
            enable_gqa=gqa))
    return torch.cat(outs, dim=2)


def cp_batches(cp: ContextParallel, rows: list, order, token_budget: int) -> list[list]:
    """The split rows' micro-batches, the same on every rank of the group (they hold the
    same split rows): in bank order (PackedLora's contiguity), cut where this rank's share
    of the tokens would pass the budget (a row whose share alone passes it runs alone)."""
    batches, current, held = [], [], 0
    for r in sorted(rows, key=lambda r: (order(r), r.req, r.datum)):
        share = -(-len(r.tokens) // cp.size)
        if current and held + share > token_budget:
            batches.append(current)
            current, held = [], 0
        current.append(r)
        held += share
    return batches + ([current] if current else [])


def cp_logprobs(model, cp: ContextParallel, rows: list) -> torch.Tensor:
    """The split rows' whole target logprobs [B, S, K] (the row layout the losses read),
    this rank having run its chunks of each."""
    from .packed import PackedLora

    dev = model.device
    pack = CpPacking.of(cp, [len(r.tokens) for r in rows], dev)
    K = max(r.targets.shape[1] if r.targets.dim() == 2 else 1 for r in rows)
    ids = torch.cat([r.tokens[loc] for r, loc in zip(rows, pack.local, strict=True)])
    tgt = torch.cat([F.pad(r.targets[loc].reshape(len(loc), -1),
                           (0, K - (r.targets.shape[1] if r.targets.dim() == 2 else 1)))
                     for r, loc in zip(rows, pack.local, strict=True)])
    lora = PackedLora([(r.adapter, len(loc)) for r, loc in zip(rows, pack.local, strict=True)],
                      model.dtype, dev)
    hidden = model.forward(ids[None].to(dev), pack.positions, lora, packing=pack)
    lp = model.target_logprobs(hidden, tgt[None].to(dev), lora)[0]
    whole = pack.whole_rows(lp)
    S = max(len(r.tokens) for r in rows)
    return torch.stack([F.pad(w, (0, 0, 0, S - w.shape[0])) for w in whole])
