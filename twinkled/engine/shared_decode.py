"""Cascade decode attention in torch: the samples of a request read their shared prompt
pages once a step, without Triton (the CPU's path; kernels/paged_decode.py is the card's).

The reference decode step (kv_pages.PagedView.write) gathers every row's pages into a
contiguous copy and runs SDPA over it: a fan-out of G samples of a P-token prompt copies
and reads the prompt's keys G times a step. Here the rows' keys split in two parts:
- each group's shared prefix (whole prompt pages, the same for all its rows), gathered
  once and attended by all the group's query heads at once (one attention call whose
  queries are the group's rows' heads: a GEMM, not G matrix-vector products);
- each row's own rest (the pages after its shared ones, masked past its position),
  gathered per row as before but only those few pages;
and the two softmaxes merge by their log-sum-exps (the split kernel's combine). Both parts
run torch's CPU flash attention (the op behind SDPA's CPU path, which also returns the
log-sum-exp); the GQA heads of a kv head ride as its query positions.

Measured on the 2-core CPU box (tiny model, 16 samples of a 400-token prompt, 32 new
tokens, rank-32 adapter, OMP_NUM_THREADS=1, best of 7): one layer's attention of the 16
rows 0.32 -> 0.19 ms, a decode step 2.26 -> 1.98 ms (one row: 1.1 ms); the call
(`bench/bench_fanout.py`) 1.9-2.3x -> 1.7-1.9x one sample. With both cores' threads the
gather's SDPA runs the 16 rows on two threads and the two paths measured alike (within
the box's noise). Same results to fp32 rounding (the softmax sums in another order):
tests/test_shared_decode.py holds it to 1e-5 against the gather. Not the default in bf16
(decode_step.py says why).

The host plan (`SharedRows`) comes from the decode step's host mirrors of each slot's group
and shared tokens, rebuilt only when rows join, move or leave; the per-step part (`at`:
the rows' rest pages and mask) is built once a step for every layer, and reads no device
value. Host-side groups make it unfit for a CUDA graph: CPU only (`DecodeStep`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SharedRows:
    """Which of a step's rows share prompt pages: `start` [B] each row's shared pages
    (its own start there; 0: it shares none), `low` the least of them, `groups` per group
    its rows (a slice where they are consecutive slots) and its shared pages, which the
    group's first row's block table lists first."""

    start: torch.Tensor
    low: int
    groups: list[tuple[slice | torch.Tensor, int, int]]  # (rows, first row, pages)

    def at(self, table: torch.Tensor, pos: torch.Tensor, page_size: int) -> SharedStep:
        """This step's part for every layer: `table` [B, n] the pages each row attends
        over, `pos` [B] its new token's position (it sees 0..pos)."""
        n, dev = table.shape[1], table.device
        W = n - self.low  # a row with fewer rest pages repeats its last, masked
        cols = (self.start[:, None] + torch.arange(W, device=dev)).clamp_(max=n - 1)
        at = self.start[:, None] * page_size + torch.arange(W * page_size, device=dev)
        mask = torch.zeros((table.shape[0], 1, 1, W * page_size), device=dev)  # (fp32: `attend`'s)
        mask.masked_fill_((at > pos[:, None])[:, None, None, :], float("-inf"))
        return SharedStep(table.gather(1, cols).reshape(-1), mask,
                          [(idx, table[first, :pages]) for idx, first, pages in self.groups])


@dataclass
class SharedStep:
    """One step's `SharedRows`: each row's rest pages (flat, W a row), their additive
    mask [B, 1, 1, W * page_size], and each group's rows and shared pages."""

    rest: torch.Tensor
    mask: torch.Tensor
    prefixes: list[tuple[slice | torch.Tensor, torch.Tensor]]


def plan(groups: list[int], shared: list[int], page_size: int,
         device: torch.device) -> SharedRows | None:
    """The plan of slots 0..len-1 from each slot's group id and shared tokens (whole
    pages); None when no two rows share (the gather is as good)."""
    members: dict[tuple[int, int], list[int]] = {}
    for b, (g, s) in enumerate(zip(groups, shared, strict=True)):
        if s > 0:
            members.setdefault((g, s), []).append(b)
    kept = [(rows, s // page_size) for (_, s), rows in members.items() if len(rows) > 1]
    if not kept:
        return None
    start = [0] * len(groups)
    out = []
    for rows, pages in kept:
        for b in rows:
            start[b] = pages
        run = rows == list(range(rows[0], rows[0] + len(rows)))
        out.append((slice(rows[0], rows[-1] + 1) if run
                    else torch.tensor(rows, device=device), rows[0], pages))
    return SharedRows(torch.tensor(start, device=device), min(start), out)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, step: SharedStep,
           page_size: int, scale: float) -> torch.Tensor:
    """One new token per row: q [B, Hq, 1, D] over a layer's pool `keys`/`values`
    [pages * page_size, Hkv, D] (the new keys already stored) -> [B, Hq, 1, Dv]."""
    B, Hq, _, D = q.shape
    Hkv, Dv, P = keys.shape[1], values.shape[2], page_size
    G = Hq // Hkv  # query heads per kv head (q head h reads kv head h // G)
    kp, vp = keys.view(-1, P, Hkv, D), values.view(-1, P, Hkv, Dv)
    # In fp32 whatever the model's dtype (no-ops in fp32): the parts and their merge round
    # once, at the end. (bf16 is not the default: decode_step.py says why.)
    qr = q[:, :, 0].float().reshape(B, Hkv, G, D)  # a kv head's query heads as its queries
    kr = kp.index_select(0, step.rest).float().view(B, -1, Hkv, D).transpose(1, 2)
    vr = vp.index_select(0, step.rest).float().view(B, -1, Hkv, Dv).transpose(1, 2)
    out, lse = _flash(qr, kr, vr, attn_mask=step.mask, scale=scale)  # [B, Hkv, G(, Dv)]
    for idx, pages in step.prefixes:
        kg = kp.index_select(0, pages).float().view(1, -1, Hkv, D).transpose(1, 2)
        vg = vp.index_select(0, pages).float().view(1, -1, Hkv, Dv).transpose(1, 2)
        qg = qr[idx]  # [m, Hkv, G, D]: all m rows' query heads against the shared keys
        m = qg.shape[0]
        o, s = _flash(qg.transpose(0, 1).reshape(1, Hkv, m * G, D), kg, vg, scale=scale)
        o, s = o.view(Hkv, m, G, Dv).transpose(0, 1), s.view(Hkv, m, G).transpose(0, 1)
        rest = out[idx]
        w = (s - lse[idx]).sigmoid_()[..., None]  # the prefix's share of the softmax mass
        out[idx] = rest + (o - rest) * w
    return out.reshape(B, Hq, 1, Dv).to(q.dtype)


def _flash(q, k, v, attn_mask=None, scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU flash attention: the output and the log-sum-exp of each query."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, attn_mask=attn_mask, scale=scale)
