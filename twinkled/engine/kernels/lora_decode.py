"""Multi-LoRA matmuls for rows that each use one adapter's columns of a stack (lora_rows.py).

The masked reference (`RowLora`) multiplies every row by every adapter's columns: its cost
grows with rows x adapters. Here (the punica SGMV/BGMV idea) a row reads only its own
adapter's columns, given per row by `start` (first column), `rank` (its columns; 0: the
base model, no delta) and `scale`:

    shrink  h[b, :rank_b] = scale_b * x[b] @ A[start_b : start_b + rank_b].T
    expand  y[b] += h[b, :rank_b] @ B[:, start_b : start_b + rank_b].T

`plan` sorts the rows by adapter once per forward (every module of every layer shares it),
so the rows of one adapter sit side by side: a kernel program takes a window of BM sorted
rows and, for each adapter in the window, reads that adapter's tile of A or B once for
all its rows there. A step then reads each adapter in the batch about once, whatever the
number of rows, and the work (flops) grows with rows x rank, not rows x all columns.

Every shape is fixed by the number of rows, and the plan is computed on the device from
the per-row buffers (no host sync), so a decode step with these kernels can be captured
in a CUDA graph. x and y stay in the model's dtype; products accumulate in fp32; h is
rounded to the model's dtype before the expand, and y + delta is rounded once, as the
masked reference (RowLora) and the trainer's fused matmul-add (lora_fused.py) round it.
The shrink splits the reduction (in) into chunks, one program each (the few windows of a
decode step would leave most of the card idle), and reads a chunk in one load per adapter;
the partial h's are summed in fp32 in a fixed order (no atomics: the same inputs give the
same bits): by each expand program for a decode step's few rows (on an H200 that beat one
sum kernel first: 7.05 against 7.56 ms below), by one sum first for a prefill's many
tokens (each expand program reading all the partials would read them out/BN times).
A shrink program sums several chunks into its partial (at most PARTIALS partials a
module), and an expand program takes NB column tiles: a decode step of the 8B's 256 rows had
each expand program read its window's 16-48 partials, from L2, for one tile of 128 columns,
more bytes than its tile of B and y; now 8 partials for two tiles. The grouped LoRA work of
a decode step (8 adapters, 36 layers) 2.96 -> 2.52 ms, 64 adapters 6.17 -> 6.12
(bench_lora_decode.py, H200, session 19; NB 1 and 4, 8 or 16 partials at 256 rows through
programs of other sizes, chunks of 128 and 512 and tiles of 64 and 256 columns all slower
at 8 adapters).

Modules that read the same x (q/k/v; gate/up) go through one launch pair (`apply_group`,
what KernelRowLora.apply_shared calls): the module is a program axis of the shrink and a
range of the expand's column blocks, each computed exactly as alone (the same bits). A decode
step of the 8B then launches 8 kernels a layer for its LoRA, not 14: at 256 rows and 8
adapters the 504 launches of a step took 3.45 ms, ~7 us each, against ~0.4 ms of bytes
(`bench_lora_decode.py` times both; the grouped figure is not measured yet).

Measured (bench/bench_lora_decode.py, H200, bf16, the 8B's 7 target modules x 36 layers,
256 rows, rank 32, one CUDA graph): 1 adapter 3.14 ms (masked 3.22), 8 adapters 3.45 ms
(masked 3.75), 64 adapters 7.05 ms (masked 6.83); a prefill of 16 prompts x 256 tokens of
16 adapters (4 layers, a stack of 64) 3.48 ms (masked: 7.21). At 256 rows a
decode step is bound by reading each adapter in the batch once (64 x r32 on the 8B: 11.2 GB),
which both paths do; the masked path's extra flops (rows x all columns) tell at more
tokens: prefill, or more rows. Below ~8 adapters both are bound by launches (two kernels a
module here, three there).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BM = 16  # rows per window (tl.dot needs >= 16)
GROUP = 3  # modules one launch takes (apply_group: q/k/v)
BN = 128  # output columns per expand tile
NB = 2  # column tiles per expand program (it reads its window's h once for both)
CHUNK = {2: 256, 4: 128}  # the shrink's reduction length per load, by element size
# The most partial sums a module's shrink leaves: a program sums several chunks of the
# reduction in one partial where there are more, so that the expand, which reads every
# partial of its window, reads a few, not k / CHUNK of them (48 for the 8B's down
# projection); a decode step of 256 rows still runs 128 programs a module. It depends on the
# reduction's length alone: never on the rows (a row gets the same bits in any batch, which
# the prefix cache's samples rely on) nor on the group (a module alone and grouped: the same).
PARTIALS = 8
# The loop over a window's adapters: a `for` on the GPU (its loads pipeline); Triton's
# interpreter takes no loop bounds read from tensors, so there a `while`.
SUM_ROWS = 256  # more rows than this: the partial h's are summed once, before the expand
DYN_FOR = os.environ.get("TRITON_INTERPRET") != "1"
_NONE = 1 << 40  # the sort key of rows without an adapter: after every adapter's


@dataclass
class RowPlan:
    """Rows sorted by adapter, per sorted position: the row, its segment (-1: no adapter),
    its adapter's first column and rank, and its scale."""

    order: torch.Tensor  # int32 [N]
    seg: torch.Tensor  # int32 [N]
    start: torch.Tensor  # int32 [N]
    rank: torch.Tensor  # int32 [N]
    scale: torch.Tensor  # fp32 [N]


def plan(start: torch.Tensor, rank: torch.Tensor, scale: torch.Tensor) -> RowPlan:
    """The sorted plan of rows with per-row `start`, `rank` (0: none) and `scale`."""
    key = torch.where(rank > 0, start.long(), _NONE)
    skey, order = torch.sort(key, stable=True)
    new = torch.ones_like(skey, dtype=torch.int32)
    new[1:] = (skey[1:] != skey[:-1]).int()
    seg = torch.where(skey == _NONE, -1, new.cumsum(0, dtype=torch.int32) - 1).int()
    return RowPlan(order.int(), seg, start.index_select(0, order).int(),
                   rank.index_select(0, order).int(), scale.index_select(0, order).float())


def rank_block(rank: int) -> int:
    """The power of two >= max(rank, 16) that the kernels tile an adapter's columns by."""
    return max(16, triton.next_power_of_2(rank))


def apply(p: RowPlan, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, y: torch.Tensor,
          rb: int, chunk: int | None = None) -> torch.Tensor:
    """y[b] += scale_b * (x[b] @ A[cols_b].T) @ B[:, cols_b].T for the rows of `p`; x: [N, in],
    A: [width, in], B: [out, width], y: [N, out] (written in place); every adapter's rank
    <= `rb` (a power of two >= 16). `chunk`: the shrink's reduction per program (a power
    of two; default by dtype)."""
    apply_group(p, x, [A], [B], [y], rb, chunk)
    return y


def apply_group(p: RowPlan, x: torch.Tensor, As: list[torch.Tensor], Bs: list[torch.Tensor],
                ys: list[torch.Tensor], rb: int, chunk: int | None = None) -> None:
    """`apply` for up to GROUP modules that read the same x (q/k/v; gate/up), in one shrink
    and one expand launch: a module is a program axis of the shrink and a range of the
    expand's column blocks. Each module's delta is what `apply` adds (the same partial sums
    in the same order: the same bits), so a decode step launches 2 kernels a group where it
    launched 2 a module (the 8B: 8 a layer, not 14). The A's share x's width and the B's the
    stack's; the outputs may be views of one joint output (fused_ops.Joint)."""
    m = len(As)
    assert 1 <= m <= GROUP and len(Bs) == m == len(ys)
    n, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    chunk = chunk or CHUNK.get(x.element_size(), 128)
    windows = triton.cdiv(n, BM)
    iters, split = split_of(triton.cdiv(k, chunk))
    h = torch.empty((m, split, n, rb), dtype=torch.float32, device=x.device)
    exact = "ieee" if x.dtype == torch.float32 else "tf32"  # tf32: ignored for 16-bit inputs
    a = [*As, *As[:1] * (GROUP - m)]  # (unused pointers: never read)
    _shrink[(windows, split, m)](x, *a, h, p.order, p.seg, p.start, p.rank, p.scale, n, k,
                                 x.stride(0), As[0].stride(0), CHUNK=chunk, ITERS=iters, BM=BM,
                                 RB=rb, PRECISION=exact, DYN_FOR=DYN_FOR)
    if split > 1 and n > SUM_ROWS:
        h, split = h.sum(1, keepdim=True), 1
    # a module's programs: NB column tiles each; [0, end0) module 0's, [end0, end1) 1's
    progs = [triton.cdiv(triton.cdiv(y.shape[1], BN), NB) for y in ys]
    pad = GROUP - m
    b, y = [*Bs, *Bs[:1] * pad], [*ys, *ys[:1] * pad]
    out, sb, sy = ([*v, *v[:1] * pad] for v in ([t.shape[1] for t in ys],
                                                 [t.stride(0) for t in Bs],
                                                 [t.stride(0) for t in ys]))
    _expand[(windows, sum(progs))](h, *b, *y, p.order, p.seg, p.start, p.rank, n, *out, *sb,
                                   *sy, progs[0], sum(progs[:2]), SPLIT=split, BM=BM, BN=BN,
                                   NB=NB, RB=rb, PRECISION=exact, DYN_FOR=DYN_FOR)


def split_of(chunks: int) -> tuple[int, int]:
    """(chunks a shrink program sums, partial sums) for a reduction of `chunks` chunks: at
    most PARTIALS partials."""
    iters = triton.cdiv(chunks, PARTIALS)
    return iters, triton.cdiv(chunks, iters)


@triton.jit
def _window(seg_ptr, order_ptr, start_ptr, rank_ptr, n, BM: tl.constexpr):
    """A window's sorted rows: positions, validity, row ids, segments and their range."""
    pos = tl.program_id(0) * BM + tl.arange(0, BM)
    valid = pos < n
    seg = tl.load(seg_ptr + pos, mask=valid, other=-1)
    row = tl.load(order_ptr + pos, mask=valid, other=0)
    start = tl.load(start_ptr + pos, mask=valid, other=0)
    rank = tl.load(rank_ptr + pos, mask=valid, other=0)
    live = seg >= 0
    lo = tl.min(tl.where(live, seg, 1 << 30), axis=0)
    hi = tl.max(tl.where(live, seg, -1), axis=0)
    return pos, valid, seg, row, start, rank, lo, hi


@triton.jit
def _columns(s, seg, start, rank):
    """Segment s's rows in the window, and its adapter's first column and rank."""
    mine = seg == s
    return mine, tl.max(tl.where(mine, start, 0), axis=0), tl.max(tl.where(mine, rank, 0), axis=0)


@triton.jit
def _shrink_one(acc, s, seg, start, rank, row, x_ptr, a_ptr, stride_x, stride_a, k, first,
                CHUNK: tl.constexpr, ITERS: tl.constexpr, RB: tl.constexpr,
                PRECISION: tl.constexpr):
    mine, st, rk = _columns(s, seg, start, rank)
    r = tl.arange(0, RB)
    for it in range(ITERS):  # this program's chunks of the reduction, in order (a loop the
        # compiler pipelines: unrolled, a prefill's 48 chunks wanted 768 KB of shared memory)
        kk = first + it * CHUNK + tl.arange(0, CHUNK)
        km = kk < k
        # (int64 offsets: a prefill's tokens x its width pass 2**31 on wide models)
        xt = tl.load(x_ptr + row.to(tl.int64)[:, None] * stride_x + kk[None, :],
                     mask=mine[:, None] & km[None, :], other=0.0)
        at = tl.load(a_ptr + (st + r)[None, :] * stride_a + kk[:, None],
                     mask=(r < rk)[None, :] & km[:, None], other=0.0)  # A^T chunk [CHUNK, RB]
        acc = acc + tl.dot(xt, at, input_precision=PRECISION)
    return acc


@triton.jit
def _shrink(x_ptr, a0_ptr, a1_ptr, a2_ptr, h_ptr, order_ptr, seg_ptr, start_ptr, rank_ptr,
            scale_ptr, n, k, stride_x, stride_a, CHUNK: tl.constexpr, ITERS: tl.constexpr,
            BM: tl.constexpr, RB: tl.constexpr, PRECISION: tl.constexpr,
            DYN_FOR: tl.constexpr):
    pos, valid, seg, row, start, rank, lo, hi = _window(seg_ptr, order_ptr, start_ptr,
                                                        rank_ptr, n, BM)
    mod = tl.program_id(2)  # the group's module (apply_group)
    a_ptr = a0_ptr
    if mod == 1:
        a_ptr = a1_ptr
    elif mod == 2:
        a_ptr = a2_ptr
    scale = tl.load(scale_ptr + pos, mask=valid, other=0.0)
    sp = tl.program_id(1)
    first = sp * ITERS * CHUNK
    acc = tl.zeros((BM, RB), dtype=tl.float32)
    if DYN_FOR:  # the adapters in this window, each over its own rows
        for s in range(lo, hi + 1):
            acc = _shrink_one(acc, s, seg, start, rank, row, x_ptr, a_ptr, stride_x, stride_a,
                              k, first, CHUNK, ITERS, RB, PRECISION)
    else:
        s = lo
        while s <= hi:
            acc = _shrink_one(acc, s, seg, start, rank, row, x_ptr, a_ptr, stride_x, stride_a,
                              k, first, CHUNK, ITERS, RB, PRECISION)
            s += 1
    acc = acc * scale[:, None]
    r = tl.arange(0, RB)
    base = (mod * tl.num_programs(1) + sp).to(tl.int64) * n * RB
    tl.store(h_ptr + base + pos[:, None] * RB + r[None, :], acc, mask=valid[:, None])


@triton.jit
def _expand_one(acc, s, seg, start, rank, h, b_ptr, stride_b, cols, cm, RB: tl.constexpr,
                PRECISION: tl.constexpr):
    mine, st, rk = _columns(s, seg, start, rank)
    r = tl.arange(0, RB)
    bt = tl.load(b_ptr + cols[None, :] * stride_b + (st + r)[:, None],
                 mask=(r < rk)[:, None] & cm[None, :], other=0.0)  # B^T tile [RB, BN]
    # h in the model's dtype, as the reference rounds it
    hs = tl.where(mine[:, None], h, 0.0).to(b_ptr.dtype.element_ty)
    return acc + tl.dot(hs, bt, input_precision=PRECISION)


@triton.jit
def _expand_tile(h, b_ptr, y_ptr, stride_b, stride_y, out, tile, seg, start, rank, row, lo, hi,
                 BM: tl.constexpr, BN: tl.constexpr, RB: tl.constexpr,
                 PRECISION: tl.constexpr, DYN_FOR: tl.constexpr):
    """One column tile of a window: y[rows, cols] += its rows' h @ their adapter's B tile."""
    cols = tile * BN + tl.arange(0, BN)
    cm = cols < out
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if DYN_FOR:
        for s in range(lo, hi + 1):
            acc = _expand_one(acc, s, seg, start, rank, h, b_ptr, stride_b, cols, cm, RB,
                              PRECISION)
    else:
        s = lo
        while s <= hi:
            acc = _expand_one(acc, s, seg, start, rank, h, b_ptr, stride_b, cols, cm, RB,
                              PRECISION)
            s += 1
    live = seg >= 0
    # int64: rows x width pass 2**31 where a wide batch's every cached token goes
    # through a wide linear (DeepSeek's kv_b_proj: 196,608 tokens x 32,768 outputs)
    ptrs = y_ptr + row.to(tl.int64)[:, None] * stride_y + cols[None, :]
    m = live[:, None] & cm[None, :]
    y = tl.load(ptrs, mask=m, other=0.0)
    # y + delta rounded once, as RowLora's and the trainer's matmul-adds round it (a
    # rounding that differs parts the two sides' logprobs: docs/reference.md)
    tl.store(ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _expand(h_ptr, b0_ptr, b1_ptr, b2_ptr, y0_ptr, y1_ptr, y2_ptr, order_ptr, seg_ptr,
            start_ptr, rank_ptr, n, out0, out1, out2, sb0, sb1, sb2, sy0, sy1, sy2, end0, end1,
            SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr,
            RB: tl.constexpr, PRECISION: tl.constexpr, DYN_FOR: tl.constexpr):
    pos, valid, seg, row, start, rank, lo, hi = _window(seg_ptr, order_ptr, start_ptr,
                                                        rank_ptr, n, BM)
    # The group's module of this program (apply_group): programs [0, end0) are module 0's,
    # [end0, end1) module 1's, the rest module 2's; each takes NB column tiles.
    prog = tl.program_id(1)
    mod = (prog >= end0).to(tl.int32) + (prog >= end1).to(tl.int32)
    first = tl.where(prog >= end1, end1, tl.where(prog >= end0, end0, 0))
    b_ptr, y_ptr, out, stride_b, stride_y = b0_ptr, y0_ptr, out0, sb0, sy0
    if mod == 2:
        b_ptr, y_ptr, out, stride_b, stride_y = b2_ptr, y2_ptr, out2, sb2, sy2
    elif mod == 1:
        b_ptr, y_ptr, out, stride_b, stride_y = b1_ptr, y1_ptr, out1, sb1, sy1
    if hi >= lo:  # a window of base-model rows (or padding) adds nothing
        r = tl.arange(0, RB)
        h = tl.zeros((BM, RB), dtype=tl.float32)
        for sp in range(0, SPLIT):  # the shrink's partial sums, in a fixed order
            base = (mod * SPLIT + sp).to(tl.int64) * n * RB
            h += tl.load(h_ptr + base + pos[:, None] * RB + r[None, :],
                         mask=valid[:, None], other=0.0)
        for t in tl.static_range(NB):  # (tiles past the module's width write nothing)
            _expand_tile(h, b_ptr, y_ptr, stride_b, stride_y, out, (prog - first) * NB + t,
                         seg, start, rank, row, lo, hi, BM, BN, RB, PRECISION, DYN_FOR)
