"""Images in the sampler's prompts (a vision-language model): what the running batch's prefill
and decode need beyond the tokens.

A prompt's images are embedded by the frozen tower once (`PromptVision.embed`, at its first
piece) and spliced at their placeholders in every prefill piece that holds some, as training
splices them (vision.py): a chunked prompt or one whose start came from the prefix cache may
cut an image's placeholder run anywhere, so a piece takes its placeholders' rows of the
whole prompt's embeddings. Its positions are the prompt's multimodal RoPE positions
(mrope.py) over the piece.

Decoding: after an image the text's rotary position is no longer its KV index (the image's
placeholders advance it by the grid's extent, not their count). The prompt's `delta` (the
`mrope_position_deltas` of transformers' get_rope_index: last position + 1 - length) is
added to every decoded token's KV index, so decode continues the positions transformers'
`generate` uses (decode_step.DecodeStep keeps it per slot).

The prefix cache keys a prompt with images by their content hashes too (`cache_key`): the
placeholder token ids are the same for every image, its KV is not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from . import mrope
from .vision import Images


@dataclass(eq=False)
class PromptVision:
    """One prompt's images (protocol/images.PreparedImage), positions and rope delta."""

    images: tuple
    positions: torch.Tensor  # [3, n] the whole prompt's mRoPE positions (host)
    is_image: torch.Tensor  # [n] bool: a placeholder position
    rank: torch.Tensor  # [n] a placeholder's row in `embed`'s output
    delta: int  # a decoded token's rotary position = its KV index + delta
    embeddings: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def of(cls, model, prompt: Sequence[int], images: Sequence) -> PromptVision | None:
        """None for a prompt without images (the text path, unchanged)."""
        if not images:
            return None
        tower = model.vision
        pos = mrope.row_positions(prompt, tower.image_token_id,
                                  [im.grid_thw for im in images], tower.merge_size)
        is_image = torch.as_tensor(list(prompt)) == tower.image_token_id
        return cls(tuple(images), pos, is_image, is_image.long().cumsum(0) - 1,
                   int(pos.max()) + 1 - len(prompt))

    def embed(self, model) -> torch.Tensor:
        """[image tokens, 1 + levels, hidden] of all the prompt's images (vision.Images),
        computed once."""
        if self.embeddings is None:
            pixels = torch.cat([torch.from_numpy(im.pixel_values) for im in self.images])
            self.embeddings = model.vision.embed(pixels, [im.grid_thw for im in self.images])
        return self.embeddings


def rope_delta(vision: PromptVision | None) -> int:
    return 0 if vision is None else vision.delta


def cache_key(weights: tuple, images: Sequence) -> tuple:
    """A prefix-cache weights key (prefix_cache.weights_key) that names a prompt's images
    (protocol/images.PreparedImage) too."""
    return (*weights, *(im.digest for im in images)) if images else weights


def pass_inputs(model, pieces: Sequence[tuple[PromptVision | None, int, int]],
                width: int | None) -> tuple[torch.Tensor, Images] | None:
    """mRoPE positions and the images of a prefill pass whose pieces are (vision, start,
    end) spans of their prompts; None when no piece has images (the text path). `width`:
    the padded pass's row width ([3, U, width]); None: packed end to end ([3, 1, T])."""
    if all(v is None for v, _, _ in pieces):
        return None
    parts, index, rows, at = [], [], [], 0
    for v, start, end in pieces:
        n = end - start
        pos = mrope.text_row(n, start) if v is None else v.positions[:, start:end]
        if width is not None and width > n:  # pads after the piece: any positions do
            pos = torch.cat([pos, mrope.text_row(width - n)], dim=1)
        parts.append(pos)
        if v is not None:
            local = v.is_image[start:end].nonzero()[:, 0]
            if local.numel():
                index.append(local + at)
                rows.append(v.embed(model)[v.rank[start:end][local].to(v.embeddings.device)])
        at += n if width is None else width
    positions = torch.stack(parts, dim=1) if width is not None else mrope.packed(parts)
    dev = model.device
    if not index:  # this pass's pieces of image prompts hold text only
        return positions.to(dev), None
    images = Images(None, (), torch.cat(index).to(dev), torch.cat(rows))
    return positions.to(dev), images
