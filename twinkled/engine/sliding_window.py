"""Sliding-window attention masks: a query at position p sees keys at p - window < j <= p.

That is transformers' `sliding_window` convention (the window counts the query's own key).
The masks are built from positions, so the same rule holds for a training row (positions
0..S-1), each segment of a packed row (positions restart at every segment), the sampler's
prefill pieces (queries start..end over keys 0..end) and a decode step (one query at its
row's position over the row's pages). The KV cache keeps every key: a window only hides
keys, so pages and the prefix cache are the same as for full attention.
"""

from __future__ import annotations

import torch


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Which keys each query sees: bool [..., S, L] for query positions [..., S] and key
    positions [L]; causal, and within `window` when set (None: full attention)."""
    q, k = q_pos[..., :, None], k_pos[None, :]
    seen = k <= q
    if window is not None:
        seen = seen & (k > q - window)
    return seen


def narrow(mask: torch.Tensor, window: int | None) -> torch.Tensor:
    """A causal bool mask [B, 1, S, L] (keys 0..p visible to the query at p, as the decode
    step builds it) narrowed to the window: the query's position is its last visible key."""
    if window is None:
        return mask
    keys = torch.arange(mask.shape[-1], device=mask.device)
    last = (mask * keys).amax(dim=-1, keepdim=True)
    return mask & (keys > last - window)
