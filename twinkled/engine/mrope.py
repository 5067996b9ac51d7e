"""Multimodal RoPE positions (Qwen2-VL / Qwen2.5-VL): three rows (t, h, w) per token.

A text token's three positions are equal and count on from the last one; an image's
placeholder tokens take (t0, t0 + row, t0 + column) over its merged patch grid, and the text
after it resumes at t0 + max(rows, columns). A row without images gets positions that equal
the 1-D ones the engine uses today, so text-only rows in the same packed step are unchanged.
Packed rows each start at 0 (as their 1-D positions do): `packed` concatenates them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def row_positions(tokens: Sequence[int], image_token_id: int,
                  grids: Sequence[tuple[int, int, int]], merge_size: int,
                  start: int = 0) -> torch.Tensor:
    """[3, len(tokens)] positions of one row. `grids`: each image's (t, h, w) patch grid
    (before the merger), in the order its placeholder runs appear."""
    ids = torch.as_tensor(list(tokens), dtype=torch.long)
    out = torch.empty(3, len(ids), dtype=torch.long)
    is_image = (ids == image_token_id).tolist()
    pos, i, n, g = start, 0, len(ids), 0
    while i < n:
        j = i
        while j < n and is_image[j] == is_image[i]:
            j += 1
        if not is_image[i]:
            out[:, i:j] = torch.arange(pos, pos + j - i)
            pos += j - i
        else:
            # A run of placeholders may hold several images back to back: take grids until
            # the run is covered.
            k = i
            while k < j:
                if g >= len(grids):
                    raise ValueError("more image placeholder tokens than images")
                t, h, w = grids[g]
                g += 1
                gh, gw = h // merge_size, w // merge_size
                count = t * gh * gw
                tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw),
                                            indexing="ij")
                out[:, k:k + count] = torch.stack([tt, hh, ww]).reshape(3, -1) + pos
                pos += max(gh, gw)
                k += count
            if k != j:
                raise ValueError("image placeholder tokens do not match the images' grids")
        i = j
    if g != len(grids):
        raise ValueError(f"{len(grids)} images but placeholders for {g}")
    return out


def packed(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """[3, 1, T]: rows' positions end to end, as a packed micro-batch holds them."""
    return torch.cat(list(rows), dim=1)[:, None, :]


def text_row(length: int, start: int = 0) -> torch.Tensor:
    """[3, length]: a text-only row (all three equal the 1-D positions)."""
    return torch.arange(start, start + length).expand(3, -1).clone()
