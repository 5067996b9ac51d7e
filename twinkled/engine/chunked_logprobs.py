"""Target logprobs straight from the final hidden states, never holding [tokens, vocab].

Training needs log_softmax(h W^T + LoRA delta)[target] for every token, in fp32, and its
gradient. Computing the logits whole keeps [tokens, vocab] in the compute dtype for the
backward and a gradient of the same size (2.5 GB for 8 x 512 tokens of a 152k vocabulary
in bf16; 20 GB for one 32k-token row). Here the head runs a chunk of tokens at a time:
per chunk the logits (base lm_head plus each token's own adapter's lm_head delta), their
logsumexp, the target logits, and then the chunk is freed. One fp32 number per token
(the logsumexp) and one hidden-width vector per token are kept, and the softmax of
chunks with lm_head adapters within a bound (below).

The gradient of lp_k = logits[t_k] - lse wrt the logits is onehot(t_k) - softmax, so
with g_k the gradient arriving at lp_k and total = sum_k g_k:
    d hidden = sum_k g_k W[t_k] - total * (softmax @ W)   (+ the LoRA terms).
`softmax @ W` does not depend on g: a chunk whose tokens have no lm_head adapter computes
it in the forward, while its softmax is at hand, and its backward is a gather of W's rows
(the lm_head costs what the unchunked path costs: one matmul forward, one for the
gradient). A chunk with lm_head adapters needs softmax^T (total * u) for B's gradient,
which needs g: it keeps its softmax in the compute dtype, up to KEEP_BYTES for the pass,
and beyond that recomputes its logits in the backward (one more matmul for those tokens).

Below FULL_LOGITS_MAX of logits the engine keeps the whole-logits path (losses.py): it is
as fast or faster there, and the memory saved is small (see FULL_LOGITS_MAX).

Why our own torch code rather than a library: liger-kernel's fused linear cross-entropy
returns only a (reduced) loss, while the RL losses need each token's logprob (and clients
get them back), and it has no per-token LoRA delta on the head; the tensor-parallel
vocabulary split (tp.py) keeps its own path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from twinkled.protocol.sizing import FULL_LOGITS_MAX  # (protocol/sizing.py counts it too)

# fp32 bytes of one chunk of logits: bounds the transient memory of the head; big enough
# that each chunk's matmul runs at the card's rate (440 tokens of a 152k vocabulary).
CHUNK_BYTES = 256 * 2**20
# Softmax (compute dtype) of the chunks with lm_head adapters that a pass keeps for its
# backward; past it, chunks recompute their logits there. 8 x 512 tokens of a 152k
# vocabulary keep 1.2 GB in bf16; a 32k-token row recomputes most of its chunks.
KEEP_BYTES = 2 * 2**30
# "auto" (the default) takes the whole logits while they stay under FULL_LOGITS_MAX in the
# compute dtype, the chunked head above it. Measured on an H200 (bench_engine.py --head
# both, 8 adapters x 1 x 512, r=32): the chunked head was level on the 8B shape (10,537 vs
# 10,473 tok/s) but 14% slower on the 0.5B (23,200 vs 27,129: its lm_head is a quarter of
# the model, and a chunk's softmax @ W, 440 x 152k by 152k x 896, runs far below the card's
# rate), while the memory it saves grows with the tokens: 2.3 GiB at 4096 tokens on the
# 8B; one row of 16k (32k) tokens on the 8B's widths with 12 layers, adapters on lm_head
# too: 11 (21) GiB, the peak 46.6 against 57.7 (19.5 against 40.6), for 2.7% of tok/s.
HEADS = ("auto", "chunked", "full")


def wanted(head: str, tokens: int, vocab: int, dtype: torch.dtype) -> bool:
    """Whether a pass of `tokens` runs the chunked head (`head`: one of HEADS)."""
    if head == "auto":
        return tokens * vocab * dtype.itemsize > FULL_LOGITS_MAX
    return head == "chunked"


@dataclass(frozen=True)
class Segment:
    """A run of tokens [start, end) of a flattened batch that use one adapter's LoRA on one
    module: its weights in the compute dtype, views of its fp32 gradient buffers (a
    backward adds to them) and its scale: what the chunked head needs to add the lm_head
    delta a chunk of tokens at a time. LoraBatch and PackedLora make them (`segments`)."""

    start: int
    end: int
    A: torch.Tensor  # [r, in]
    B: torch.Tensor  # [out, r]
    gA: torch.Tensor  # [r, in] fp32, in the bank
    gB: torch.Tensor  # [out, r] fp32, in the bank
    scale: float


def segment(bank, slot: int, scale: float, key: str, start: int, end: int,
            dtype: torch.dtype) -> Segment:
    return Segment(start, end, bank.A16[key][slot].to(dtype), bank.B16[key][slot].to(dtype),
                   bank.gA[key][slot], bank.gB[key][slot], scale)


def chunked_target_logprobs(hidden: torch.Tensor, targets: torch.Tensor,
                            weight: torch.Tensor, bias: torch.Tensor | None,
                            segments: list[Segment], anchor: torch.Tensor | None = None,
                            chunk_bytes: int | None = None) -> torch.Tensor:
    """Each target's logprob [B, S(, K)] in fp32 (differentiable) from the final hidden
    states [B, S, H], the lm_head `weight` [V, H] (and `bias`) and the lm_head adapters'
    `segments` over the flattened tokens. `anchor` (the LoRA batch's) puts the pass on the
    autograd graph when only the head has adapters (hidden then needs no gradient)."""
    chunk = max(1, (chunk_bytes or CHUNK_BYTES) // (4 * weight.shape[0]))
    if anchor is None:
        anchor = hidden.new_zeros(())
    return _ChunkedHead.apply(hidden, anchor, targets, weight, bias, segments, chunk)


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, anchor, targets, weight, bias, segments, chunk):
        flat = hidden.reshape(-1, hidden.shape[-1])
        n = flat.shape[0]
        tgt = targets.reshape(n, -1)  # [tokens, K]
        train = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        lse = torch.empty(n, dtype=torch.float32, device=flat.device)
        lp = torch.empty(tgt.shape, dtype=torch.float32, device=flat.device)
        # softmax @ W of the chunks without head adapters (see the module docstring)
        pw = torch.empty_like(flat) if train else None
        kept: dict[int, torch.Tensor] = {}  # start -> softmax of a chunk with head adapters
        room = KEEP_BYTES
        for s, e, segs in _chunks(n, chunk, segments):
            logits = _logits(flat, weight, bias, segs, s, e).float()
            lse[s:e] = torch.logsumexp(logits, dim=-1)
            lp[s:e] = logits.gather(1, tgt[s:e]) - lse[s:e, None]
            if not train:
                continue
            size = (e - s) * weight.shape[0] * weight.element_size()
            if not segs or size <= room:
                probs = logits.sub_(lse[s:e, None]).exp_().to(weight.dtype)
            if not segs:
                pw[s:e] = probs @ weight
            elif size <= room:  # else its backward computes it again
                kept[s] = probs
                room -= size
        if train:
            ctx.save_for_backward(flat, tgt, weight, bias, lse, pw)
            ctx.segments, ctx.chunk, ctx.shape, ctx.kept = segments, chunk, hidden.shape, kept
        return lp.view(targets.shape)

    @staticmethod
    def backward(ctx, grad_lp):
        flat, tgt, weight, bias, lse, pw = ctx.saved_tensors
        n = flat.shape[0]
        g = grad_lp.reshape(n, -1).float()  # [tokens, K]
        total = g.sum(1, keepdim=True)
        grad = torch.zeros_like(flat)
        need = ctx.needs_input_grad[0]  # False when only the head has adapters
        for s, e, segs in _chunks(n, ctx.chunk, ctx.segments):
            if not segs:  # sum_k g_k W[t_k] - total * (softmax @ W)
                if need:
                    picked = (g[s:e, :, None] * weight[tgt[s:e]].float()).sum(1)
                    grad[s:e] = (picked - total[s:e] * pw[s:e].float()).to(grad.dtype)
                continue
            # d logits = onehot * g - softmax * total, then back through the head
            probs = ctx.kept.pop(s, None)
            if probs is None:
                probs = _logits(flat, weight, bias, segs, s, e).float()
                probs = probs.sub_(lse[s:e, None]).exp_()
            d = probs.float().mul_(-total[s:e])
            d = d.scatter_add_(1, tgt[s:e], g[s:e]).to(weight.dtype)
            del probs
            if need:
                grad[s:e] = d @ weight
            for seg in segs:
                a, b = max(seg.start, s), min(seg.end, e)
                x, dd = flat[a:b], d[a - s:b - s]
                u = (x @ seg.A.t()) * seg.scale  # [c, r], as lora._LoraDelta
                seg.gB.add_((dd.t() @ u).float())
                du = (dd @ seg.B) * seg.scale
                seg.gA.add_((du.t() @ x).float())
                if need:
                    grad[a:b] += du @ seg.A
        return grad.view(ctx.shape) if need else None, None, None, None, None, None, None


def _chunks(n: int, chunk: int, segments: list[Segment]):
    """(start, end, the segments that overlap it) for each chunk of `n` tokens."""
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        yield s, e, [seg for seg in segments if seg.start < e and seg.end > s]


def _logits(flat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            segs: list[Segment], s: int, e: int) -> torch.Tensor:
    """Logits of tokens [s, e) in the compute dtype, each with its own adapter's delta."""
    logits = torch.nn.functional.linear(flat[s:e], weight, bias)
    for seg in segs:
        a, b = max(seg.start, s), min(seg.end, e)
        u = (flat[a:b] @ seg.A.t()) * seg.scale
        logits[a - s:b - s] += u @ seg.B.t()
    return logits
