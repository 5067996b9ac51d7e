"""The vision tower of a vision-language model (Qwen2.5-VL, Qwen3-VL (-MoE), Qwen3.5 with its
image processor's files: protocol/images.takes_images), run frozen, and the splice of its
embeddings into the text embeddings at the image-placeholder positions (and, for Qwen3-VL,
its DeepStack features into the first layers' outputs: deepstack.py).

The checkpoint loads whole (transformers' own modules); `split` keeps its language model as
the engine's decoder (named as a text model's: `model.layers.N...`, so LoRA targets and
adapter files read as for Qwen2) and its vision tower beside it, never trained: LoRA is on
the language model's linears only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from twinkled.protocol.images import VL_ARCHS as ARCHS  # noqa: F401 - model.py lists them
from twinkled.protocol.images import guard_torchvision, takes_images

from . import deepstack


class TextOnly(nn.Module):
    """The language model of a VL checkpoint, shaped as a causal LM: `.model`, `.lm_head`."""

    def __init__(self, model: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.model = model
        self.lm_head = lm_head


@dataclass
class Images:
    """The images of one forward: patches of all images end to end and their grids, and the
    flat token indices (into the [B, S] input) of their placeholders, in image order.
    `embeddings`: the tower's output for exactly those placeholders, already computed (the
    sampler's prefill embeds a prompt's images once for all its pieces: vision_prefill.py);
    then the patches are not read. Level 0 is what replaces the placeholders' embeddings,
    levels 1.. are DeepStack's (deepstack.py; Qwen2.5-VL has none)."""
    pixel_values: torch.Tensor | None  # [patches, C * temporal * patch * patch]
    grids: Sequence[tuple[int, int, int]]
    index: torch.Tensor  # [image tokens] long
    embeddings: torch.Tensor | None = None  # [image tokens, 1 + levels, hidden]


class VisionTower:
    """The frozen tower + merger: images -> embeddings of the text's hidden size."""

    def __init__(self, visual: nn.Module, image_token_id: int, merge_size: int):
        self.visual = visual.eval().requires_grad_(False)
        self.image_token_id = image_token_id
        self.merge_size = merge_size

    @torch.no_grad()
    def embed(self, pixel_values: torch.Tensor, grids: Sequence[tuple[int, int, int]]
              ) -> torch.Tensor:
        """[image tokens, 1 + levels, hidden]: every image's merged patch embeddings (and
        DeepStack features), in order."""
        p = next(self.visual.parameters())
        grid = torch.as_tensor([list(g) for g in grids], dtype=torch.long, device=p.device)
        out = self.visual(pixel_values.to(device=p.device, dtype=p.dtype), grid_thw=grid)
        return deepstack.features(out)

    def features(self, images: Images) -> torch.Tensor:
        """[image tokens, 1 + levels, hidden] for `images`' placeholders."""
        emb = images.embeddings
        if emb is None:
            emb = self.embed(images.pixel_values, images.grids)
        if emb.shape[0] != images.index.numel():
            raise ValueError(f"{images.index.numel()} image placeholder tokens but the images "
                             f"make {emb.shape[0]}")
        return emb

    @staticmethod
    def splice(h: torch.Tensor, index: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """The text embeddings `h` [B, S, H] with the rows at flat `index` replaced by `emb`
        (out of place: the embedding table's gradient path stays intact for the other
        tokens)."""
        flat = h.reshape(-1, h.shape[-1]).index_copy(0, index.to(h.device), emb.to(h.dtype))
        return flat.view_as(h)


def check(tp) -> None:
    if tp is not None and tp.size > 1:
        from twinkled.protocol.types import EngineInputError

        raise EngineInputError("tp", "tensor parallelism does not split a vision-language "
                               "model yet; run it with --tp 1")


def auto_class(model_dir):
    """The transformers auto class a VL checkpoint (protocol/images.takes_images) loads with
    (None: a text model's)."""
    if not takes_images(model_dir):
        return None
    # The VL model's module imports torchvision where it looks installed: a broken one
    # (a +cpu torch beside the index's torchvision) must look absent first.
    guard_torchvision()
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText


def split(hf: nn.Module, config, device: torch.device) -> tuple[TextOnly, VisionTower]:
    """A loaded VL model (Qwen2_5_VL-, Qwen3VL-, Qwen3_5(Moe)ForConditionalGeneration) ->
    (its language model as a causal LM, its frozen tower on `device`)."""
    text = TextOnly(hf.model.language_model, hf.lm_head)
    tower = VisionTower(hf.model.visual.to(device), config.image_token_id,
                        config.vision_config.spatial_merge_size)
    return text, tower


def batch_inputs(model, rows: Sequence, width: int | None, device
                 ) -> tuple[torch.Tensor, Images] | None:
    """mRoPE positions and the images of a micro-batch whose rows (`.tokens`, `.images`:
    protocol/images.PreparedImage, in placeholder order) hold images; None when none does
    (the text path, unchanged). `width`: the padded layout's row width [3, B, width];
    None: packed end to end [3, 1, T]."""
    if model.vision is None or not any(r.images for r in rows):
        return None
    from . import mrope

    tower = model.vision
    parts, index, pixels, grids, at = [], [], [], [], 0
    for r in rows:
        n = len(r.tokens)
        grid = [im.grid_thw for im in r.images]
        pos = mrope.row_positions(r.tokens.tolist(), tower.image_token_id, grid,
                                  tower.merge_size) if r.images else mrope.text_row(n)
        if width is not None and width > n:  # pads after the row: any positions do
            pos = torch.cat([pos, mrope.text_row(width - n, int(pos.max()) + 1)], dim=1)
        parts.append(pos)
        index.append((r.tokens == tower.image_token_id).nonzero()[:, 0] + at)
        pixels += [torch.from_numpy(im.pixel_values) for im in r.images]
        grids += grid
        at += n if width is None else width
    positions = (torch.stack(parts, dim=1) if width is not None
                 else mrope.packed(parts)).to(device)
    images = Images(torch.cat(pixels), grids, torch.cat(index).to(device))
    return positions, images
