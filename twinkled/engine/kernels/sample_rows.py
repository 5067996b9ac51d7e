"""Each row's next token and its logprob straight from the logits, in one kernel.

Why: the reference choice (choose.RowChoice.choose) cost ~15% of a Qwen2.5-0.5B decode step
on an H200. At 256 rows x 151,936 vocab it makes fp32 tensors of [rows, vocab] (156 MB each)
one after another: a float() copy, log_softmax, exp, the Exp(1) noise, a division, then an
argmax and a gather: ~1.5 GB of memory traffic a step. Here a row reads its logits about
twice and nothing of [rows, vocab] is written. Its speed on a card is not measured yet.

`sample(logits, temp, u)`, one program a row on a GPU (ROWS), blocked over the vocabulary:
1. one online pass: the row's max m, the first index holding it, and
   total = sum_j exp((x_j - m) / T), accumulated in fp32 whatever the logits' dtype;
2. a sampled row (T > 0, u >= 0) reads its logits again and takes by inverse CDF the first
   token j whose running sum of exp((x_j - m) / T) exceeds u * total: token j with
   probability p_j for u uniform in [0, 1). A greedy row (T == 0, or u < 0: a row no group
   draws for, whose reference noise is 1) skips this pass and keeps the argmax (the first
   index of the max on ties, as torch.argmax);
3. logprob = (x_j - m) / T - log(total) (T read as 1 for T == 0: choose.py divides greedy
   rows by 1), the log_softmax of the row's temperature-scaled logits at j.

An inverse-CDF draw picks other tokens than the reference's exponential race for the same
generator state (the same distribution: tests/test_sample_kernel.py). u is fp32 (torch.rand:
steps of 2^-24), so each token's probability is honoured to within ~6e-8. Nothing syncs with
the host and the shapes are fixed by the rows, so the launch can sit in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # vocabulary entries a row's program reads at once (151,936: 38 blocks)
# Rows a program: one on a GPU (256 rows: 256 programs over an H200's 132 SMs). Triton's
# interpreter spends ~40 ms of Python a program whatever its size, so tests that draw
# thousands of rows take many rows a program (the same code: every reduction is per row).
ROWS = 1  # (a power of two)
NUM_WARPS = 8


def sample(logits: torch.Tensor, temp: torch.Tensor, u: torch.Tensor,
           block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token (int64 [B]) and its logprob (fp32 [B]) from `logits` [B, V] (bf16,
    fp16 or fp32; any row stride), `temp` fp32 [B] (0: greedy) and `u` fp32 [B] (a uniform
    in [0, 1) a sampled row; < 0: the argmax). `block`: BLOCK (tests: smaller)."""
    B, V = logits.shape
    if logits.stride(1) != 1:  # (unit steps along a row: vectorized loads)
        logits = logits.contiguous()
    tokens = torch.empty(B, dtype=torch.int64, device=logits.device)
    lps = torch.empty(B, dtype=torch.float32, device=logits.device)
    if B:
        blk = min(block or BLOCK, max(16, triton.next_power_of_2(V)))
        _sample_rows[(triton.cdiv(B, ROWS),)](logits, temp, u, tokens, lps, B, V,
                                              logits.stride(0), ROWS=ROWS, BLOCK=blk,
                                              num_warps=NUM_WARPS)
    return tokens, lps


@triton.jit
def _sample_rows(x_ptr, temp_ptr, u_ptr, tok_ptr, lp_ptr, B, V, stride_row,
                 ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < B
    base = x_ptr + rows.to(tl.int64) * stride_row  # [ROWS]
    t = tl.load(temp_ptr + rows, mask=live, other=1.0)
    u = tl.load(u_ptr + rows, mask=live, other=-1.0)
    greedy = (t <= 0.0) | (u < 0.0)
    inv = 1.0 / tl.where(t > 0.0, t, 1.0)
    c = inv * 1.4426950408889634  # exp(y * inv) as exp2(y * c)
    cols = tl.arange(0, BLOCK)[None, :]
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    total = tl.zeros((ROWS,), tl.float32)
    best = tl.zeros((ROWS,), tl.int32)
    for start in range(0, V, BLOCK):
        idx = start + cols
        x = tl.load(base[:, None] + idx, mask=live[:, None] & (idx < V),
                    other=float("-inf")).to(tl.float32)
        bm = tl.max(x, 1)
        best = tl.where(bm > m, start + tl.argmax(x, 1), best)  # strict: the first max stays
        new = tl.maximum(m, bm)
        safe = tl.where(new == float("-inf"), 0.0, new)  # (no -inf - -inf while all is -inf)
        total = total * tl.exp2((m - safe) * c) + tl.sum(tl.exp2((x - safe[:, None]) * c[:, None]), 1)
        m = new
    m = tl.where(m == float("-inf"), 0.0, m)
    tok = best
    if tl.max((live & ~greedy).to(tl.int32), 0) > 0:  # (a greedy row needs no second pass)
        target = (u * total)[:, None]
        found = tl.zeros((ROWS,), tl.int32) + V  # V: not reached yet
        last = best  # the last token of nonzero probability (the target rounded past the end)
        run = tl.zeros((ROWS,), tl.float32)
        for start in range(0, V, BLOCK):
            idx = start + cols
            x = tl.load(base[:, None] + idx, mask=live[:, None] & (idx < V),
                        other=float("-inf")).to(tl.float32)
            p = tl.exp2((x - m[:, None]) * c[:, None])
            # (p > 0: a token of probability 0 is never taken, whatever the scan's rounding)
            hit = (run[:, None] + tl.cumsum(p, 1) > target) & (p > 0.0)
            found = tl.minimum(found, tl.min(tl.where(hit, idx, V), 1))
            last = tl.maximum(last, tl.max(tl.where(p > 0.0, idx, -1), 1))
            run += tl.sum(p, 1)
        tok = tl.where(greedy, best, tl.where(found < V, found, last))
    xt = tl.load(base + tok, mask=live, other=0.0).to(tl.float32)
    tl.store(tok_ptr + rows, tok.to(tl.int64), mask=live)
    tl.store(lp_ptr + rows, (xt - m) * inv - tl.log(tl.where(live, total, 1.0)), mask=live)
