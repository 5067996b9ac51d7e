"""Images in chat messages (a vision-language model): `image_url` content parts of the OpenAI
face (and the Anthropic face's base64 `image` blocks), as Tinker's ImageChunk is taken.

Only inline images are served: a data URL (`data:image/png;base64,...`, png or jpeg). A
remote http(s) URL is refused by name: the daemon fetches nothing from the network (a
request must not make it reach hosts for a client, nor wait on them). Each image goes
through the same door checks as an ImageChunk (protocol/images.py: format by content, bytes,
header pixels before decoding, tokens per image and per request), in a thread.

The model's chat template places one `<|image_pad|>` per image part (Qwen2-VL's template,
as its processor does); `place` expands the i-th into the i-th image's token count, as
transformers' Qwen2-VL processor does with the text it renders.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re

from twinkled.protocol.images import (
    CheckedImage,
    ImageError,
    ImageLimits,
    check,
    check_request,
    model_vision,
)

from .errors import bad_param
from .sampling import chat_ids

_DATA_URL = re.compile(r"data:image/(png|jpeg|jpg);base64,", re.IGNORECASE)


def data_url(url: str, param: str) -> tuple[bytes, str]:
    """An image_url's bytes and format; a 400 naming `param` for anything but an inline
    png or jpeg."""
    if url.lower().startswith(("http://", "https://")):
        raise bad_param(param, "remote image URLs are not fetched by this server (it makes no "
                        "network requests): send the image inline as a data URL "
                        "(data:image/png;base64,... or data:image/jpeg;base64,...)")
    m = _DATA_URL.match(url)
    if m is None:
        raise bad_param(param, "an image URL must be a base64 data URL of a png or jpeg image "
                        "(data:image/png;base64,... or data:image/jpeg;base64,...)")
    try:
        data = base64.b64decode(url[m.end():], validate=True)
    except (binascii.Error, ValueError):
        raise bad_param(param, "the data URL's base64 payload does not decode") from None
    return data, "png" if m.group(1).lower() == "png" else "jpeg"


def chat_images(messages) -> list[tuple[bytes, str, str]]:
    """The (bytes, format, param) of every image_url part of the chat's messages, in order."""
    params = [(p.image_url.url, f"messages[{i}].content[{j}].image_url")
              for i, m in enumerate(messages) if isinstance(m.content, list)
              for j, p in enumerate(m.content) if p.type == "image_url"]
    return [(*data_url(url, param), param) for url, param in params]


def _check_all(images: list[tuple[bytes, str, str]], config, model: str) -> list[CheckedImage]:
    vision = model_vision(str(config.model))
    if vision is None:
        raise bad_param(images[0][2], f"model {model!r} takes no images (a text-only model)")
    spec, limits = vision[0], ImageLimits.of(config)
    out = []
    for data, fmt, param in images:
        try:
            out.append(check(data, fmt, spec, limits, where=param))
        except ImageError as e:
            raise bad_param(param, str(e)) from None
    try:
        check_request(out, limits)
    except ImageError as e:
        raise bad_param("messages", str(e)) from None
    return out


async def checked(images: list[tuple[bytes, str, str]], config, model: str
                  ) -> list[CheckedImage]:
    """(bytes, format, param) images decoded and checked off the event loop."""
    if not images:
        return []
    return await asyncio.to_thread(_check_all, images, config, model)


def place(ids: list[int], images: list[CheckedImage], config, param: str) -> list[int]:
    """The rendered prompt's ids with the i-th image placeholder expanded to the i-th
    image's tokens."""
    if not images:
        return ids
    pad = model_vision(str(config.model))[1]
    at = [i for i, t in enumerate(ids) if t == pad]
    if len(at) != len(images):
        raise bad_param(param, f"the chat template placed {len(at)} image placeholders for "
                        f"{len(images)} images (text may not hold the image placeholder)")
    out, last = [], 0
    for i, im in zip(at, images, strict=True):
        out += ids[last:i] + [pad] * im.tokens
        last = i + 1
    return out + ids[last:]


async def chat_prompt(request, side, messages: list[dict], images: list[tuple[bytes, str, str]],
                      model: str, prefill: str = "") -> tuple[list[int], list[CheckedImage]]:
    """A chat's prompt ids (sampling.chat_ids) with its images (`chat_images`' form)
    checked and their placeholders expanded, and the checked images."""
    from tinker_shim.common import service

    config = service(request).config
    checked_images = await checked(images, config, model)
    ids = await chat_ids(request, side, "messages", messages, prefill)
    return place(ids, checked_images, config, "messages"), checked_images
