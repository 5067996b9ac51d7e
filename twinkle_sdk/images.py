"""Images in twinkle_sdk rows (a vision-language model, e.g. Qwen2.5-VL).

An `ImageChunk` stands in a row's `input_ids` where the image goes (its `labels` entry is
ignored: image positions carry no loss), in training rows and sampling prompts alike; a
sampled row's `new_input_feature` keeps it, so it trains as it was sampled. Before a row
reaches a backend, `expand` checks the image as the daemon's door does (format, bytes,
pixels, tokens: protocol/images.py, no torch) and puts its placeholder tokens in its place.
The local backend splices the tower's embeddings there (the engine's own path); the daemon
backend sends it as a tinker ImageChunk with its token count.

The model's image processor spec comes from its files (config.json,
preprocessor_config.json): a local model directory, in local mode, or a daemon's model
named by a local directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinkled.protocol.images import CheckedImage, ImageLimits, VisionSpec, check, model_vision

from .template import IGNORE_INDEX as IGNORE


@dataclass(frozen=True)
class ImageChunk:
    """An image in a row's input_ids: its encoded bytes, png or jpeg."""

    data: bytes
    format: str = "png"


@dataclass(frozen=True)
class Vision:
    """What rows with images need of a VL model: its image processor spec and placeholder."""

    spec: VisionSpec
    pad: int

    @classmethod
    def of(cls, model_dir: str | Path | None) -> Vision | None:
        """None: a text model, or no local files to read the spec from."""
        if model_dir is None or not (Path(model_dir) / "config.json").exists():
            return None
        found = model_vision(str(model_dir))
        return None if found is None else cls(*found)


def has_images(ids: list) -> bool:
    return any(isinstance(t, ImageChunk) for t in ids)


def expand(ids: list, labels: list, vision: Vision | None
           ) -> tuple[list[int], list[int], list[CheckedImage]]:
    """A row's ids and labels with each ImageChunk's placeholder tokens in its place (labels
    ignored there), and its checked images, in order."""
    if vision is None:
        raise ValueError("a row holds an ImageChunk but the model takes no images (or its "
                         "files are not here to read its image processor from)")
    out_ids: list[int] = []
    out_labels: list[int] = []
    images: list[CheckedImage] = []
    for t, label in zip(ids, labels, strict=True):
        if isinstance(t, ImageChunk):
            im = check(t.data, t.format, vision.spec, ImageLimits(),
                       where=f"image {len(images)}")
            out_ids += [vision.pad] * im.tokens
            out_labels += [IGNORE] * im.tokens
            images.append(im)
        else:
            out_ids.append(int(t))
            out_labels.append(int(label))
    return out_ids, out_labels, images


def expand_prompt(prompt: list, vision: Vision | None) -> tuple[list[int], list[CheckedImage]]:
    """A sampling prompt's ids (its ImageChunks expanded) and its checked images."""
    if not has_images(prompt):
        return [int(t) for t in prompt], []
    ids, _, images = expand(prompt, prompt, vision)
    return ids, images


def tinker_input(tokens: list[int], images: list[CheckedImage], pad: int) -> Any:
    """Tokens (placeholders expanded) and their images as a tinker ModelInput: each image's
    run of placeholders an ImageChunk (the daemon's door expands it again)."""
    from tinker import types

    chunks: list = []
    text: list[int] = []
    it, i = iter(images), 0
    while i < len(tokens):
        if tokens[i] != pad:
            text.append(tokens[i])
            i += 1
            continue
        if text:
            chunks.append(types.EncodedTextChunk(tokens=text))
            text = []
        im = next(it)
        chunks.append(types.ImageChunk(data=im.data, format=im.format,
                                       expected_tokens=im.tokens))
        i += im.tokens
    if text:
        chunks.append(types.EncodedTextChunk(tokens=text))
    return types.ModelInput(chunks=chunks)
