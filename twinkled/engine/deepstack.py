"""DeepStack (Qwen3-VL): besides its last block's merged output, which replaces the image
placeholders' embeddings (vision.py), the vision tower merges the output of a few earlier
blocks (`deepstack_visual_indexes`, three on the released models) to the text's width, and
level k of those is added to the hidden states at the placeholders after text layer k.

The tower's features travel as one tensor [image tokens, 1 + levels, hidden] (level 0: the
embeddings), so every consumer that picks a prompt's placeholder rows (the sampler's chunked
prefill, vision_prefill.py) picks all levels of them at once. Qwen2.5-VL has no levels.
"""

from __future__ import annotations

import torch


def features(out) -> torch.Tensor:
    """[image tokens, 1 + levels, hidden]: a tower's output (transformers' vision model's:
    `pooler_output` the merged output, `deepstack_features` a tensor a level, if any)."""
    merged = out.pooler_output if hasattr(out, "pooler_output") else out
    return torch.stack([merged, *(getattr(out, "deepstack_features", None) or ())], dim=1)


def add(h: torch.Tensor, index: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
    """`h` [B, S, H] with one level's features [image tokens, H] added at the placeholders'
    flat `index` (out of place: the layer's output stays as autograd saved it)."""
    flat = h.reshape(-1, h.shape[-1]).index_add(0, index.to(h.device), level.to(h.dtype))
    return flat.view_as(h)
