"""Attention with sinks: a learned logit per head that joins every softmax's denominator.

gpt-oss (and any architecture that takes these) gives each head a scalar `sink`: the softmax
over a query's visible keys gets one more term, exp(sink), whose value is nothing. A head
can so put weight "nowhere" instead of on the first tokens. The output is

    out = sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j)),  s_j = scale * q . k_j

`attend` runs it through SDPA (its memory-efficient kernel on a GPU keeps no [S, L]
probabilities for the backward) as one extra key: every query gets one more dimension
holding sink / scale, the extra key is 1 there and 0 elsewhere (real keys 0 there), its
value is 0. So q . k_sink * scale = sink for every query of the head, whatever the kv-head
grouping, and the softmax is exactly the one above. `attend_eager` is the formula op by op
(transformers' eager form; the reference tests compare with).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PAD = 8  # extra head dims (the sink's, then zeros): head dims stay multiples of 8


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           sinks: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """q [B, H, S, D], k/v [B, Hkv, L, D], sinks [H], `visible` bool broadcastable to
    [B, H, S, L] (which keys each query sees) -> [B, H, S, D]."""
    B, H, S, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    extra = q.new_zeros(B, H, S, PAD)
    extra[..., 0] = (sinks.float() / scale).to(q.dtype)[None, :, None]
    q2 = torch.cat([q, extra], dim=-1)
    sink_key = k.new_zeros(B, Hkv, 1, D + PAD)
    sink_key[..., D] = 1
    k2 = torch.cat([torch.cat([k, k.new_zeros(B, Hkv, L, PAD)], dim=-1), sink_key], dim=2)
    v2 = torch.cat([v, v.new_zeros(B, Hkv, 1, D)], dim=2)
    seen = torch.cat([visible, visible.new_ones(*visible.shape[:-1], 1)], dim=-1)
    return F.scaled_dot_product_attention(q2, k2, v2, attn_mask=seen, scale=scale,
                                          enable_gqa=H != Hkv)


def attend_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 sinks: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """`attend` op by op: scores, the sink's column, softmax, the sink's share dropped."""
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
