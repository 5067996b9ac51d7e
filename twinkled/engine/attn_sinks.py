"""Attention with sinks: a learned logit per head that joins every softmax's denominator.

gpt-oss (and any architecture that takes these) gives each head a scalar `sink`: the softmax
over a query's visible keys gets one more term, exp(sink), whose value is nothing. A head
can so put weight "nowhere" instead of on the first tokens. The output is

    out = sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j)),  s_j = scale * q . k_j

This is the eager form (the reference, and what every path here runs: training rows,
packed segments, the sampler's prefill pieces and decode). SDPA and flash attention take no
sink term; a fused kernel would take the LSE and rescale by sigmoid(lse - sink).
"""

from __future__ import annotations

import torch


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           sinks: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """q [B, H, S, D], k/v [B, Hkv, L, D], sinks [H], `visible` bool broadcastable to
    [B, H, S, L] (which keys each query sees) -> [B, H, S, D]."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:  # grouped-query attention: each kv head serves `rep` query heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    logits = torch.cat([scores, sink], dim=-1)
    # The sink is finite, so a query that sees no key (a pad) still has a finite softmax.
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]  # the sink's share carries no value
    return torch.matmul(probs.to(v.dtype), v)
