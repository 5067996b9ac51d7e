"""Shared prefixes: rows of one adapter that begin alike compute their common start once.

An RL batch holds G rollouts of each prompt; run as G separate rows, every rollout pays for
its prompt again (80% of an 8B RL step's training tokens, measured). Here such rows become a
*group*: its shared positions are packed once, each row's own rest after them, so a group
costs prompt + G x completion. Forward and backward both: autograd sums the rows' gradients
into the shared positions.

What may be shared is exact, not approximate. Position t's hidden state depends on tokens
0..t, its logprob also on the target at t (by convention token t+1, but the client gives
targets explicitly). So a group shares the positions where every member has the same token
AND the same target(s): for rows that share a prompt of P tokens that is P - 1 positions
(position P - 1 predicts each row's own first new token), and each row's rest starts there.
Losses are then taken per row from logprobs gathered back into the row layout, with each
row's own weights, advantages and sampler logprobs, as on the unshared path.

Attention: a shared segment is causal within itself, like any packed row; a member's rest
attends to the whole shared segment and then causally to itself (positions continue from
the shared length, so RoPE sees each row's true positions).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from twinkled.protocol.prefixes import common_units

from . import flash_varlen
from .lora import Adapter
from .packed import Packing, varlen_attend

# Rows sharing fewer leading positions than this run apart. Each group costs host work
# (sorting, index building) and one more attention segment, and a GPU kernel works in
# tiles of 64-128 positions: under ~32 shared positions the saving is lost in those.
MIN_SHARED = 32


class RowLike(Protocol):
    adapter: Adapter | None
    tokens: torch.Tensor  # [N]
    targets: torch.Tensor  # [N] or [N, K]


@dataclass
class Group:
    """Rows of one adapter packed as one shared segment and each member's rest; `shared`
    is 0 for a row alone (or rows that share nothing)."""

    rows: list
    shared: int = 0

    @property
    def cost(self) -> int:
        """Positions the model computes for this group."""
        return self.shared + sum(len(r.tokens) - self.shared for r in self.rows)


class TokenCount:
    """Row tokens and the tokens actually computed for them, summed until taken (a test
    and the bench read how much sharing saved)."""

    def __init__(self) -> None:
        self.rows = self.computed = 0

    def add(self, rows: int, computed: int) -> None:
        self.rows += rows
        self.computed += computed

    def take(self) -> tuple[int, int]:
        out = (self.rows, self.computed)
        self.rows = self.computed = 0
        return out


TOKENS = TokenCount()


def _bytes(r: RowLike) -> tuple[bytes, bytes, int]:
    """A row's tokens and targets as bytes (compared in C, not a tensor op per pair), and
    its targets per position."""
    targets = r.targets.reshape(len(r.tokens), -1)
    return (r.tokens.numpy().tobytes(), targets.numpy().tobytes(),
            targets.shape[1] if r.targets.dim() == 2 else 0)


def common_length(a: tuple[bytes, bytes, int], b: tuple[bytes, bytes, int]) -> int:
    """Leading positions where two rows (as `_bytes`) have the same token and target(s)."""
    if a[2] != b[2]:  # one target per position against several
        return 0
    return min(common_units(a[0], b[0]), common_units(a[1], b[1], 8 * max(1, a[2])))


def group_rows(rows: Sequence[RowLike], min_shared: int) -> list[Group]:
    """Cut `rows` (each adapter's rows together, as a micro-batch orders them) into groups.

    Within an adapter, rows sorted by their tokens put rows with long common starts next to
    each other; a row joins the group before it while the group's common start stays at
    least `min_shared`. `min_shared` 0: every row alone, in the given order."""
    if min_shared <= 0:
        return [Group([r]) for r in rows]
    groups: list[Group] = []
    i = 0
    while i < len(rows):
        j = i
        while j < len(rows) and rows[j].adapter is rows[i].adapter:
            j += 1
        # Sorted by (targets per position, token bytes): whole tokens are 8 bytes each, so
        # rows with a common start of tokens sit together, as in any lexicographic order.
        run = sorted(((_bytes(r), r) for r in rows[i:j]), key=lambda x: (x[0][2], x[0][0]))
        (key, first), shared = run[0], len(run[0][1].tokens)
        group, last = [first], key
        for key, r in run[1:]:
            common = min(shared, common_length(last, key))
            if common >= min_shared:
                group.append(r)
                shared = common
            else:
                groups.append(Group(group, shared if len(group) > 1 else 0))
                group, shared = [r], len(r.tokens)
            last = key
        groups.append(Group(group, shared if len(group) > 1 else 0))
        i = j
    return groups


def split_group(group: Group, space: int, budget: int) -> tuple[Group, Group | None]:
    """The most members of `group` whose cost fits `space` (at least one if `space` is a
    whole `budget`: a row longer than the budget runs alone), and the rest (or None)."""
    if group.cost <= space:
        return group, None
    taken = 0
    cost = group.shared
    while taken < len(group.rows) and cost + len(group.rows[taken].tokens) - group.shared <= space:
        cost += len(group.rows[taken].tokens) - group.shared
        taken += 1
    if taken == 0 and space < budget:
        return Group([]), group
    taken = max(taken, 1)
    head, rest = group.rows[:taken], group.rows[taken:]

    def part(members: list) -> Group:
        return Group(members, group.shared if len(members) > 1 else 0)

    return part(head), part(rest) if rest else None


@dataclass
class Layout:
    """A micro-batch's groups as one packed sequence, and the way back to the row layout."""

    ids: torch.Tensor  # [T] tokens in packed order
    targets: torch.Tensor  # [T, K]
    segments: list[tuple[Adapter | None, int]]  # (adapter, positions) in packed order
    packing: Packing | SharedPacking
    rows: int
    longest: int  # the longest row (S of the row layout)
    source: torch.Tensor  # [sum N] packed index of each row position
    row: torch.Tensor  # [sum N] which row
    pos: torch.Tensor  # [sum N] which position of it

    @staticmethod
    def of(groups: list[Group], device) -> Layout:
        # Host work per row (numpy: a tensor op per row would cost more than the
        # arithmetic for a step of hundreds of short rows).
        rows = [r for g in groups for r in g.rows]
        K = max(r.targets.shape[1] if r.targets.dim() == 2 else 1 for r in rows)
        segs: list[tuple[RowLike, int, int, tuple[int, int] | None]] = []  # row, lo, hi
        source = []
        at = 0
        for g in groups:
            first = at
            if g.shared:
                segs.append((g.rows[0], 0, g.shared, None))
                at += g.shared
            for r in g.rows:
                n = len(r.tokens)
                source += [np.arange(first, first + g.shared), np.arange(at, at + n - g.shared)]
                if n > g.shared:
                    segs.append((r, g.shared, n, (first, g.shared) if g.shared else None))
                    at += n - g.shared
        ids = np.concatenate([r.tokens.numpy()[lo:hi] for r, lo, hi, _ in segs])
        if K == 1 and all(r.targets.dim() == 1 for r in rows):
            targets = np.concatenate([r.targets.numpy()[lo:hi] for r, lo, hi, _ in segs])[:, None]
        else:
            targets, t = np.zeros((at, K), dtype=np.int64), 0
            for r, lo, hi, _ in segs:
                part = r.targets.numpy()[lo:hi].reshape(hi - lo, -1)
                targets[t:hi - lo + t, :part.shape[1]] = part
                t += hi - lo
        spans, t = [], 0
        for _, lo, hi, _ in segs:
            spans.append((t, hi - lo, lo))
            t += hi - lo
        prefixes = [p for *_, p in segs]
        if any(p is not None for p in prefixes):
            packing = SharedPacking.of(spans, prefixes, device)
        else:
            packing = Packing.of([n for _, n, _ in spans], device)
        lengths = np.array([len(r.tokens) for r in rows])
        row = np.repeat(np.arange(len(rows)), lengths)
        pos = np.arange(len(row)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        return Layout(torch.from_numpy(ids), torch.from_numpy(targets),
                      [(r.adapter, hi - lo) for r, lo, hi, _ in segs], packing, len(rows),
                      int(lengths.max()),
                      *(torch.from_numpy(x).to(device) for x in (np.concatenate(source), row, pos)))

    def unpack(self, lp: torch.Tensor) -> torch.Tensor:
        """Packed logprobs [T, K] -> the row layout [rows, S, K] the losses read (zero past
        each row's end); a shared position's logprob goes to every member (its gradient is
        their sum)."""
        return lp.new_zeros((self.rows, self.longest, lp.shape[-1])).index_put(
            (self.row, self.pos), lp[self.source])


@dataclass
class SharedPacking:
    """Attention over packed segments, some of which continue a shared segment: a
    continuation attends to its shared segment's keys in full, then causally to its own.
    Same interface as Packing (`positions`, `attend`)."""

    spans: list[tuple[int, int]]  # (start, length) of each segment
    prefixes: list[tuple[int, int] | None]  # (start, length) of the segment it continues
    positions: torch.Tensor  # [1, T]
    cu_q: torch.Tensor  # [segments + 1] int32
    cu_k: torch.Tensor  # [segments + 1] int32: each segment's keys (shared ones first)
    keys: torch.Tensor  # [sum of key lengths] packed index of each segment's keys
    longest_q: int
    longest_k: int

    @staticmethod
    def of(spans: list[tuple[int, int, int]], prefixes: list[tuple[int, int] | None],
           device) -> SharedPacking:
        """`spans`: (start, length, first position) of each segment in packed order."""
        keys, cu_q, cu_k = [], [0], [0]
        for (start, n, _), p in zip(spans, prefixes, strict=True):
            if p is not None:
                keys.append(np.arange(p[0], p[0] + p[1]))
            keys.append(np.arange(start, start + n))
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + n + (p[1] if p is not None else 0))
        positions = np.concatenate([np.arange(lo, lo + n) for _, n, lo in spans])
        counts = np.diff(cu_k)
        return SharedPacking(
            [(s, n) for s, n, _ in spans], prefixes, torch.from_numpy(positions).to(device)[None],
            *(torch.tensor(c, dtype=torch.int32, device=device) for c in (cu_q, cu_k)),
            torch.from_numpy(np.concatenate(keys)).to(device), max(n for _, n, _ in spans),
            int(counts.max()))

    @cached_property
    def plan(self) -> flash_varlen.Plan:
        """The same attention as flash's calls (flash_varlen.py), made when first used."""
        return flash_varlen.Plan.of(self.spans, self.prefixes, self.positions.device)

    def memory_tokens(self) -> int:
        """Tokens a pass keeps for its backward, for the recompute decision: the packed
        tokens, and each shared key once more per continuation that reads it (the flash
        path gathers a copy of the shared keys and values per continuation, kept per layer
        when layers are not recomputed: +24 GB on an 8B group of 8 x 16 rollouts, which
        ran an H200 out of memory beside the sampler's pool). A key counts as a whole
        token: an overestimate (a key and value are a fraction of a token's activations)
        that errs towards recomputing. Through flash's own calls (flash_varlen.py, a GPU in
        half precision) the keys are read in place: the packed tokens only."""
        tokens = int(self.positions.shape[1])
        if flash_varlen.SHARED and flash_varlen.ENABLED and self.positions.is_cuda:
            return tokens
        return tokens + int(self.keys.shape[0])

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               gqa: bool) -> torch.Tensor:
        """q [1, H, T, D], k/v [1, Hkv, T, D] -> [1, H, T, D]."""
        if flash_varlen.SHARED and flash_varlen.available(q):  # shared keys read in place
            return flash_varlen.attend(q, k, v, self.plan, scale)
        if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
            return self.attend_varlen(q, k, v, scale, gqa)
        outs = []
        for (start, n), p in zip(self.spans, self.prefixes, strict=True):
            s = slice(start, start + n)
            if p is None:
                outs.append(F.scaled_dot_product_attention(
                    q[:, :, s], k[:, :, s], v[:, :, s], is_causal=True, scale=scale,
                    enable_gqa=gqa))
                continue
            shared = slice(p[0], p[0] + p[1])
            kk, vv = (torch.cat([t[:, :, shared], t[:, :, s]], dim=2) for t in (k, v))
            # Causal aligned to the keys' end: query i sees shared keys and own keys <= i.
            mask = torch.ones((n, p[1] + n), dtype=torch.bool, device=q.device).tril(p[1])
            outs.append(F.scaled_dot_product_attention(
                q[:, :, s], kk, vv, attn_mask=mask, scale=scale, enable_gqa=gqa))
        return torch.cat(outs, dim=2)

    def attend_varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      gqa: bool, kernel=varlen_attend) -> torch.Tensor:
        """Through a variable-length kernel (`kernel`: flash attention's; a test passes a
        reference of its semantics). Each segment's keys are gathered end to end (a shared
        segment's once per continuation); the kernel's causal mask is aligned to the end of
        a segment's keys, so a continuation's queries see every shared key and their own
        causally."""
        # Gathered token-major ([keys, kv heads, dim]: the kernel's layout), so that making
        # them token-major for the kernel is no second copy of every gathered key.
        kk, vv = (t[0].transpose(0, 1).index_select(0, self.keys).transpose(0, 1)[None]
                  for t in (k, v))
        return kernel(q, kk, vv, self.cu_q, self.cu_k, self.longest_q, self.longest_k, scale,
                      gqa)
