"""Image chunks at the tinker door: each datum's ImageIns decoded, checked against the
daemon's image limits and expanded into the model's placeholder tokens (protocol/images.py).
Runs in a thread (`asyncio.to_thread`): decoding and resizing never hold the event loop."""

from __future__ import annotations

import msgspec

from twinkled.protocol.errors import UserError
from twinkled.protocol.frames import ImageF
from twinkled.protocol.images import (
    CheckedImage,
    ImageError,
    ImageLimits,
    check,
    check_request,
    model_vision,
    read_pointer,
)

from .codec import DatumIn, ImageIn
from .messages import ModelInputIn


def expand(data: list[DatumIn], config, model_name: str, name: str | None = None
           ) -> tuple[list[DatumIn], list[list[CheckedImage]]]:
    """The datums with every image's placeholder tokens in place, and their images; a bad
    image is the client's error (a 400 naming it). `name`: what the one datum is called in
    errors (default: data[j].model_input)."""
    try:
        return _expand(data, config, model_name, name)
    except ImageError as e:
        raise UserError(str(e)) from None


def expand_prompt(prompt: ModelInputIn, config, model_name: str
                  ) -> tuple[list[int], list[CheckedImage]]:
    """A sampling prompt's tokens with its images' placeholders in place, and its images
    (ImageChunk bytes, or an ImageAssetPointerChunk's file under image_dir)."""
    tokens: list[int] = []
    images: list[ImageIn] = []
    for i, c in enumerate(prompt.chunks):
        if c.type == "encoded_text":
            tokens += c.tokens
        elif c.type in ("image", "image_asset_pointer"):
            try:
                data = c.data if c.type == "image" else read_pointer(
                    c.location, ImageLimits.of(config), f"prompt.chunks[{i}]")
            except ImageError as e:
                raise UserError(str(e)) from None
            images.append(ImageIn(len(tokens), data, c.format, c.expected_tokens))
        else:
            raise UserError(f"prompt.chunks[{i}]: chunks of type {c.type!r} are not supported")
    out, ims = expand([DatumIn(tokens, {}, images=images)], config, model_name, "prompt")
    return out[0].tokens, ims[0]


def _expand(data: list[DatumIn], config, model_name: str, name: str | None
            ) -> tuple[list[DatumIn], list[list[CheckedImage]]]:
    vision = model_vision(str(config.model))
    if vision is None:
        raise ImageError(f"model {model_name!r} takes no images (a text-only model)")
    spec, pad = vision
    limits = ImageLimits.of(config)
    out, images = [], []
    for j, d in enumerate(data):
        where = name or f"data[{j}].model_input"
        if pad in d.tokens:  # the tower's rows would not match the placeholders
            raise ImageError(f"{where}: a text chunk holds the image placeholder "
                             f"token ({pad}); images come as ImageChunks")
        tokens, ims, last = [], [], 0
        for k, chunk in enumerate(d.images):
            im = check(chunk.data, chunk.format, spec, limits, chunk.expected_tokens,
                       where=f"{where} image {k}")
            tokens += d.tokens[last:chunk.at] + [pad] * im.tokens
            last = chunk.at
            ims.append(im)
        out.append(msgspec.structs.replace(d, tokens=tokens + d.tokens[last:], images=[]))
        images.append(ims)
    check_request([im for ims in images for im in ims], limits)
    return out, images


def image_frames(images: list[CheckedImage], config) -> list[ImageF]:
    """A datum's checked images as frames, with the spec the workers patchify them by."""
    if not images:
        return []
    spec = model_vision(str(config.model))[0]
    return [ImageF(im.data, im.format, list(im.grid_thw), im.tokens, im.digest, spec)
            for im in images]
