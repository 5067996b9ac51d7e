"""Decode attention straight from the KV pages: one new query token per row (flash-decoding).

`paged_decode(q, keys, values, table, lengths, page_size, scale)` is what
`F.scaled_dot_product_attention` computes over each row's gathered pages with a causal mask
(kv_pages.PagedView.write and the model's SDPA, the reference path), without the gather: a
program reads its row's keys and values in place, token slot by token slot through the block
table, so a step moves each row's KV once instead of about three times.

The work is split in two kernels. `_split_kernel` runs one program per (row, kv head, split):
it takes all G = Hq / Hkv query heads that share the kv head (GQA) as the rows of one tile
(padded to 16, what `tl.dot` needs), walks its split's share of the row's tokens in tiles of
BLOCK_N (a tile may span several pages: every token looks its page up), keeps an online
softmax and writes its partial (max, sum, output). `_combine_kernel` merges the splits of
each (row, head). The number of splits depends only on (rows, kv heads, pages attended), the
shape of a decode bucket, never on the lengths, so a captured CUDA graph stays valid; a
program whose split lies past its row's length loads nothing and writes an empty partial.
Nothing syncs with the host.

Tuning (bench/check_paged_decode.py, one H200, bf16, the Qwen3-8B layout of 32 query and 8
kv heads of 128): one layer's decode attention for 256 rows of up to 768 tokens takes
0.127 ms (3.2 TB/s of KV) against 0.59 ms for the gather + SDPA; 32 rows of up to 4096
tokens, split 6 ways, 0.099 ms against 0.40. Tiles of 64 tokens beat 32 (0.148 vs 0.156 ms
at 1 stage, 0.127 vs 0.133 at 3) and equal 128; 4 warps beat 8; 3 pipeline stages beat 1.
The KV page size made no difference (16, 32 or 64 tokens within 3%: a tile spans pages),
so pages stay at 16 tokens (running.PAGE_SIZE), where a short prompt wastes least.

Cascade (`prefix`, paged_decode.prefix_groups). The samples of one request share their
prompt's full pages (running.py), and a flat kernel reads them once per row: a fan-out of
32 prompts x 8 samples of 512 + 256 tokens reads ~24 GB of KV a step on the 8B where ~7 GB
hold it. With a `prefix`, `_prefix_kernel` reads each group's shared pages once per kv head:
its tile's rows are up to `members` rows of the group x their G query heads (32 on the 8B),
so one K/V tile feeds every member's `tl.dot`; it writes a partial per (row, head) beside
the rows' own splits, which `_split_kernel` now runs from each row's `start` (its shared
tokens) on, and the combine merges them all (skipping the prefix partials of rows that share
nothing). The groups are device data, chunked each step on the device (no host sync, a
CUDA graph replays it); the grid depends on the bucket alone: cdiv(rows, members) chunk
programs x kv heads x prefix splits, each program looping over the chunks it is dealt
(one each in a fan-out; a bucket of many small groups deals a program several).
Measured on one H200 (bench/check_paged_decode.py --cascade, bf16, 8B heads, 256 rows in
groups of 8, 512 shared + up to 256 own tokens): one layer's attention 0.168 ms flat, 0.106
ms cascade (+0.095 ms once a step for prefix_groups); TUNE swept there: one prefix split
(fill 1: 0.109 vs 0.129 ms at 2), 128-token prefix tiles (0.106 vs 0.107 at 64, 0.115 at
32), 4 warps (8: 0.119), 3 stages (1: 0.136); the rows' own kernel 2 stages (1: 0.131).
bench/bench_sampling.py --shape qwen3-8b --paths flat,new, fan-out: 23.0 -> 20.8 ms a decode
step, 10,033 -> 10,989 new tok/s a call (11,125 -> 12,309 in decode steps). The flat kernel
already gets much of a group's rereads from L2 (3.99 TB/s of rows' KV for groups of 8
against 3.22 for rows sharing nothing), so the win is ~1.6x a layer, not the 3.4x of bytes.

Why not torch's flex_attention with paged block masks (torch.nn.attention.experimental.
_paged_attention): its physical block mask must use the page size as its KV block size and be
rebuilt from the block tables every step; it is compiled by inductor per bucket shape (many
decode buckets, each a compile inside our own CUDA-graph capture), and on CPU the tests would
check inductor's C++ code rather than the kernel the GPU runs. This kernel is one Triton
source that Triton's interpreter runs on CPU (the tests) and that compiles once per head
layout and tiles-per-split step (a handful over a process's life, each in a graph's warm-up). FlashInfer needs JIT builds carried to the GPU machines.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # tokens per tile (any power of two >= 16; independent of the page size)
# One part a row (many rows, or short ones): the split kernel writes the row's output, no
# partials and no combine kernel (the 8B's wide decode, 256 rows: 36 kernels a step fewer,
# ~6 us each). The same bits as the combine (tests/test_engine_kernels.py); checked on an
# H200 (`gpu_pass.sh direct`: the running and q/k prep tests compiled, 30 passed) and timed
# there: the 8B wide step 16.23 -> 16.07 ms, the fan-out (several parts a row) unchanged.
DIRECT = True
MAX_SPLITS = 64
# The cascade's launch: pipeline stages of the rows' own kernel (short loops then), the
# prefix kernel's stages, warps, tile and how many times its programs fill the card. Swept
# by bench/check_paged_decode.py --cascade --sweep on one H200 (the module's doc).
TUNE = {"suffix_stages": 2, "prefix_stages": 3, "prefix_warps": 4, "prefix_block_n": 128,
        "prefix_fill": 1}


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, start_ptr, m_ptr, l_ptr, o_ptr,
                  sq_b, sq_h, sk_t, sk_h, sv_t, sv_h, st_b, scale_log2, PARTS, so_b, so_h,
                  START: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_N: tl.constexpr, PAGE: tl.constexpr, TILES: tl.constexpr,
                  IEEE: tl.constexpr, TO_LENGTH: tl.constexpr, DIRECT: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    gm, dm = g < G, d < D
    heads = kvh * G + g  # query heads of this kv head (repeat_interleave order, as SDPA's GQA)
    q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + d[None, :],
                mask=gm[:, None] & dm[None, :], other=0.0)
    length = tl.load(len_ptr + b)
    # START: the row's first tokens (its group's shared prefix) are _prefix_kernel's
    start = tl.load(start_ptr + b) if START else 0
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, BLOCK_D], tl.float32)
    # The launch is the bucket's; the loop stops at the row's length (TO_LENGTH, compiled).
    # Triton's interpreter cannot take a loop bound loaded from memory (numpy >= 2.4), so
    # there it runs the bucket's tiles: those past the length load nothing and add nothing.
    trips = tl.minimum(TILES, tl.cdiv(length - start - s * TILES * BLOCK_N, BLOCK_N))
    for i in range(0, trips if TO_LENGTH else TILES):
        tok = start + (s * TILES + i) * BLOCK_N + n
        live = tok < length
        page = tl.load(table_ptr + b * st_b + tok // PAGE, mask=live, other=0)
        slot = page * PAGE + tok % PAGE
        kv_mask = live[:, None] & dm[None, :]
        k = tl.load(k_ptr + slot[:, None] * sk_t + kvh * sk_h + d[None, :], mask=kv_mask,
                    other=0.0)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = tl.where(live[None, :], scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing live yet: no NaN
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(scores - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + slot[:, None] * sv_t + kvh * sv_h + d[None, :], mask=kv_mask,
                    other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if DIRECT:  # the row's only part: its output (o_ptr: [B, Hq, D] in q's dtype), as the
        # combine of one partial computes it (acc * 1 / (l * 1): the same bits)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + b * so_b + heads[:, None] * so_h + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=gm[:, None] & dm[None, :])
    else:
        # partials [B, Hq, PARTS(, D)], contiguous: this row's splits, then its prefix's
        row = (b * (tl.num_programs(1) * G) + heads) * PARTS + s
        _store_partial(m_ptr, l_ptr, o_ptr, row, gm, m_i, l_i, acc, d, dm, D)


@triton.jit
def _store_partial(m_ptr, l_ptr, o_ptr, row, rm, m_i, l_i, acc, d, dm, D: tl.constexpr):
    """A partial (max, sum, output) of rows `row` where `rm`; an empty one (nothing
    attended: max -inf) stores its max alone, which is all the combine reads of it."""
    tl.store(m_ptr + row, m_i, mask=rm)
    full = rm & (m_i > float("-inf"))
    tl.store(l_ptr + row, l_i, mask=full)
    tl.store(o_ptr + row[:, None] * D + d[None, :], acc, mask=full[:, None] & dm[None, :])


@triton.jit
def _prefix_kernel(q_ptr, k_ptr, v_ptr, table_ptr, pre_ptr, order_ptr, count_ptr, starts_ptr,
                   chunks_ptr, m_ptr, l_ptr, o_ptr, sq_b, sq_h, sk_t, sk_h, sv_t, sv_h, st_b,
                   scale_log2, PARTS, FIRST, G: tl.constexpr, G_PAD: tl.constexpr,
                   ROWS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr, PAGE: tl.constexpr, TILES: tl.constexpr,
                   CHUNK_TRIPS: tl.constexpr, IEEE: tl.constexpr, TO_LENGTH: tl.constexpr):
    """One program per (chunk slot, kv head, prefix split). Chunk c (prefix_groups: the
    chunks' first positions in `order`, `chunks` of them) is rows order[j], order[j + 1],
    ... (count[j] samples of one request); those rows x the G query heads of the kv head
    are the rows of one tile, so each tile of the shared prefix (pre[order[j]] tokens, the
    first row's pages) is loaded once for all of them. A program takes chunks c, c + C, ...
    (C programs: a bucket's rows over the chunk size, so a fan-out's chunks take one each);
    split `ps` of PS takes tiles ps, ps + PS, ...: balanced whatever the prefix's length."""
    c0 = tl.program_id(0)
    kvh = tl.program_id(1)
    ps = tl.program_id(2)
    n_prog, n_split = tl.num_programs(0), tl.num_programs(2)
    r = tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    member, gh = r // G_PAD, r % G_PAD
    dm = d < D
    heads = kvh * G + gh
    chunks = tl.load(chunks_ptr)
    mine = (chunks - c0 + n_prog - 1) // n_prog
    for ci in range(0, mine if TO_LENGTH else CHUNK_TRIPS):
        c = c0 + ci * n_prog
        j = tl.load(starts_ptr + c, mask=c < chunks, other=0)
        count = tl.where(c < chunks, tl.load(count_ptr + j), 0)
        rm = (member < count) & (gh < G)
        slot = tl.load(order_ptr + j + member, mask=member < count, other=0)
        lead = tl.load(order_ptr + j)
        prefix = tl.where(count > 0, tl.load(pre_ptr + lead), 0)
        q = tl.load(q_ptr + slot[:, None] * sq_b + heads[:, None] * sq_h + d[None, :],
                    mask=rm[:, None] & dm[None, :], other=0.0)
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
        trips = (tl.cdiv(prefix, BLOCK_N) - ps + n_split - 1) // n_split
        for i in range(0, trips if TO_LENGTH else TILES):
            tok = (i * n_split + ps) * BLOCK_N + n
            live = tok < prefix
            page = tl.load(table_ptr + lead * st_b + tok // PAGE, mask=live, other=0)
            kv_slot = page * PAGE + tok % PAGE
            kv_mask = live[:, None] & dm[None, :]
            k = tl.load(k_ptr + kv_slot[:, None] * sk_t + kvh * sk_h + d[None, :],
                        mask=kv_mask, other=0.0)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where(live[None, :], scores * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(scores - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv_slot[:, None] * sv_t + kvh * sv_h + d[None, :],
                        mask=kv_mask, other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        row = (slot * (tl.num_programs(1) * G) + heads) * PARTS + FIRST + ps
        _store_partial(m_ptr, l_ptr, o_ptr, row, rm, m_i, l_i, acc, d, dm, D)


@triton.jit
def _combine_kernel(m_ptr, l_ptr, o_ptr, out_ptr, start_ptr, so_b, so_h, SPLITS, FIRST,
                    S_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                    START: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, BLOCK_D)
    sm, dm = s < SPLITS, d < D
    if START:  # partials FIRST.. are the prefix's, written only for rows that share one
        # tl.where keeps the mask boolean: Triton 3.9's interpreter widens a bool tensor
        # or-ed with a loaded scalar's comparison to int32, which tl.load refuses
        sm = sm & tl.where(tl.load(start_ptr + b) > 0, s >= 0, s < FIRST)
    row = (b * tl.num_programs(1) + h) * SPLITS + s
    m = tl.load(m_ptr + row, mask=sm, other=float("-inf"))
    sm = sm & (m > float("-inf"))  # an empty partial stored its max alone
    l_s = tl.load(l_ptr + row, mask=sm, other=0.0)
    o = tl.load(o_ptr + row[:, None] * D + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
    top = tl.max(m, 0)  # some partial holds the row's new token: finite
    w = tl.where(sm, tl.exp2(m - top), 0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(l_s * w, 0)
    tl.store(out_ptr + b * so_b + h * so_h + d, out.to(out_ptr.dtype.element_ty), mask=dm)


@functools.cache
def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: split as an H100 would
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_plan(rows: int, kv_heads: int, tokens: int, device: torch.device,
               block_n: int = BLOCK_N) -> tuple[int, int]:
    """(splits, tiles per split) of each row's `tokens`: enough programs to fill the card
    about twice, tiles per split coarsely rounded (it is compiled in: few variants). A
    function of the bucket's shape only, so a CUDA graph replays it."""
    tiles = triton.cdiv(tokens, block_n)
    want = max(1, min(triton.cdiv(2 * _sms(device), rows * kv_heads), tiles, MAX_SPLITS))
    per = _coarse(triton.cdiv(tiles, want))
    return triton.cdiv(tiles, per), per


def _coarse(n: int) -> int:
    """n rounded up to a power of two or 1.5 times one, as the decode buckets' pages are:
    few compiled variants, and a bucket's tiles fill its splits."""
    b = 1
    while b < n:
        if b >= 2 and b * 3 // 2 >= n:
            return b * 3 // 2
        b *= 2
    return b


def members(heads: int, kv_heads: int) -> int:
    """Rows of a group one prefix program takes (a bigger group is split into chunks):
    up to 8, fewer where the query heads per kv head would make its tile over 64 rows."""
    return max(1, min(8, 64 // triton.next_power_of_2(heads // kv_heads)))


@dataclass(frozen=True)
class Prefix:
    """Which rows share a prefix, as `_prefix_kernel` reads it: `start` [B] each row's
    shared prefix tokens (0: none; its own kernel reads it all), `order` [B] the rows
    sorted so a group's rows are adjacent (rows sharing nothing last), `count` [B] at each
    position of `order` that starts a chunk of a group (at most `chunk` rows), its rows;
    `starts` [B] those positions first, in order; `chunks` (a 0-d tensor) how many."""

    start: torch.Tensor
    order: torch.Tensor
    count: torch.Tensor
    starts: torch.Tensor
    chunks: torch.Tensor
    chunk: int


def prefix_groups(group: torch.Tensor, shared: torch.Tensor, chunk: int) -> Prefix:
    """The chunks of rows that share a prefix, on the device, without a host sync (so a
    CUDA graph captures it): rows with the same `group` id and `shared` > 0 tokens share
    their first `shared` tokens' pages (a group of one row too: its prefix kernel reads
    what its own would have). `chunk`: the most rows a chunk takes (`members`)."""
    rows = group.shape[0]
    idx = torch.arange(rows, device=group.device)
    sharing = shared > 0
    key = torch.where(sharing, group, torch.iinfo(torch.long).max)  # group ids: >= 0
    skey, order = torch.sort(key, stable=True)
    first = torch.searchsorted(skey, skey)
    end = torch.searchsorted(skey, skey, right=True)
    head = ((idx - first) % chunk == 0) & sharing[order]
    count = torch.where(head, torch.clamp(end - idx, max=chunk), 0)
    starts = torch.sort(torch.where(head, idx, rows + idx)).values
    return Prefix(shared, order, count, starts, head.sum(), chunk)


def prefix_plan(rows: int, kv_heads: int, tokens: int, device: torch.device, chunk: int,
                block_n: int = BLOCK_N) -> tuple[int, int, int]:
    """(chunk programs, splits, tiles per split) of a shared prefix of up to `tokens`:
    a program per `chunk` rows of the bucket, splits enough to fill the card
    `TUNE["prefix_fill"]` times. Shape only, as split_plan."""
    programs = triton.cdiv(rows, chunk)
    tiles = triton.cdiv(tokens, block_n)
    want = triton.cdiv(TUNE["prefix_fill"] * _sms(device), programs * kv_heads)
    splits = _coarse(max(1, min(want, tiles, MAX_SPLITS)))
    return programs, splits, triton.cdiv(tiles, splits)


def paged_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 table: torch.Tensor, lengths: torch.Tensor, page_size: int,
                 scale: float, block_n: int = BLOCK_N, warps: int = 4, stages: int = 3,
                 prefix: Prefix | None = None) -> torch.Tensor:
    """Attention of one new token per row over its pages.

    q [B, Hq, D] (any strides with a unit last one); keys/values: a layer's pool
    [pages * page_size, Hkv, D]; table [B, P] the pages of each row in order (P pages are
    attended at most); lengths [B] each row's tokens (>= 1; its new token included, already
    written). Returns [B, Hq, D] in q's dtype. `block_n`, `warps`, `stages`: tuning knobs
    (tokens per tile, warps and pipeline stages of the split kernel). `prefix`
    (prefix_groups): rows whose first tokens are shared, read once per chunk of rows
    (cascade); each row's own kernel then reads from its `start` on."""
    B, Hq, D = q.shape
    Hkv = keys.shape[1]
    if q.stride(2) != 1 or keys.stride(2) != 1 or values.stride(2) != 1:
        raise ValueError("paged_decode needs a unit stride on the head dimension")
    G = Hq // Hkv
    tokens = table.shape[1] * page_size
    splits, per = split_plan(B, Hkv, tokens, q.device, block_n)
    chunk = 1 if prefix is None else prefix.chunk
    pre_n = TUNE["prefix_block_n"]
    programs, pre_splits, pre_per = (0, 0, 0) if prefix is None else prefix_plan(
        B, Hkv, tokens, q.device, chunk, pre_n)
    parts = splits + pre_splits
    dev, f32 = q.device, torch.float32
    out = torch.empty((B, Hq, D), dtype=q.dtype, device=dev)
    # One part a row (many rows, or short ones): the split kernel writes the output itself,
    # no partials and no combine (a kernel a layer less: the 8B's wide decode, 256 rows).
    direct = parts == 1 and DIRECT
    if direct:  # (no partials: the kernel reads no m, l)
        m = l_ = o = out
    else:
        m = torch.empty((B, Hq, parts), dtype=f32, device=dev)
        l_ = torch.empty((B, Hq, parts), dtype=f32, device=dev)
        o = torch.empty((B, Hq, parts, D), dtype=f32, device=dev)
    block_d = triton.next_power_of_2(D)
    g_pad = triton.next_power_of_2(G)
    to_length = os.environ.get("TRITON_INTERPRET") != "1"
    strides = (q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0),
               values.stride(1), table.stride(0), scale * 1.4426950408889634)
    start = lengths if prefix is None else prefix.start
    _split_kernel[(B, Hkv, splits)](
        q, keys, values, table, lengths, start, m, l_, o, *strides, parts, out.stride(0),
        out.stride(1), START=prefix is not None, G=G, G_PAD=max(16, g_pad), D=D,
        BLOCK_D=block_d, BLOCK_N=block_n, PAGE=page_size, TILES=per,
        IEEE=q.dtype == torch.float32, TO_LENGTH=to_length, DIRECT=direct, num_warps=warps,
        num_stages=stages if prefix is None else TUNE["suffix_stages"])
    if direct:
        return out
    if prefix is not None:
        _prefix_kernel[(programs, Hkv, pre_splits)](
            q, keys, values, table, prefix.start, prefix.order, prefix.count, prefix.starts,
            prefix.chunks, m, l_, o, *strides, parts, splits, G=G, G_PAD=g_pad,
            ROWS=max(16, chunk * g_pad), D=D, BLOCK_D=block_d, BLOCK_N=pre_n, PAGE=page_size,
            # the interpreter's loop bounds (unused compiled: no variant per value)
            TILES=1 if to_length else pre_per,
            CHUNK_TRIPS=1 if to_length else triton.cdiv(B, programs),
            IEEE=q.dtype == torch.float32, TO_LENGTH=to_length,
            num_warps=TUNE["prefix_warps"], num_stages=TUNE["prefix_stages"])
    _combine_kernel[(B, Hq)](m, l_, o, out, start, out.stride(0), out.stride(1), parts,
                             splits, S_PAD=triton.next_power_of_2(parts), D=D,
                             BLOCK_D=block_d, START=prefix is not None)
    return out
