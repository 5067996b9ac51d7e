"""Images at the door: decode a chunk's bytes under limits, and turn it into a vision model's
patches and placeholder-token count (Qwen2-VL's image processor, which Qwen2.5-VL and Qwen3-VL
use too, with their own patch sizes and normalisation).

Everything here runs before a request is queued (off the event loop: `asyncio.to_thread`), so
a corrupt file, an unknown format or a decompression bomb is a 400 naming what is wrong and
never reaches a worker. The patches come from transformers' PIL image processor (the "slow"
one: PIL + numpy), never its torchvision one: on a `+cpu` torch the torchvision an index serves
may be broken (`operator torchvision::nms does not exist`), and `guard_torchvision` makes such
an install look absent before transformers' image modules are imported.
"""

from __future__ import annotations

import importlib
import io
import json
import math
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

if TYPE_CHECKING:
    import numpy as np

# Vision-language architectures (engine/vision.py), named here for the torch-free door.
VL_ARCHS = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
# Natively multimodal ones (Qwen3.5): their checkpoints hold a vision tower; with its image
# processor's files (preprocessor_config.json) they take images, without them text only.
NATIVE_VL_ARCHS = ("qwen3_5", "qwen3_5_moe")
# The processor's default normalisation (CLIP's), which Qwen2.5-VL's files also name.
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# The bytes a format's files begin with: a chunk's declared format must match its content.
_MAGIC = {"png": (b"\x89PNG\r\n\x1a\n",), "jpeg": (b"\xff\xd8\xff",)}
_PIL_FORMAT = {"png": "PNG", "jpeg": "JPEG"}


class ImageError(ValueError):
    """A permanent problem with an image: answered as a 400 with this message."""


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 * 2**20  # encoded bytes of one image
    max_pixels: int = 40_000_000  # width x height of one image, read from its header
    max_tokens: int = 16384  # placeholder tokens of one image
    request_max_tokens: int = 65536  # placeholder tokens of all images of one request
    image_dir: Path | None = None  # ImageAssetPointerChunk: file:// paths under it; None: refused

    @classmethod
    def of(cls, config: object) -> ImageLimits:
        """The limits a daemon config names (its image_* keys)."""
        image_dir = getattr(config, "image_dir", "")
        return cls(max_bytes=config.image_max_bytes, max_pixels=config.image_max_pixels,
                   max_tokens=config.image_max_tokens,
                   request_max_tokens=config.request_max_image_tokens,
                   image_dir=Path(image_dir).resolve() if image_dir else None)


def guard_torchvision() -> None:
    """Make a torchvision that fails to import look absent to transformers (which otherwise
    imports it from its image utilities and fails with it). Idempotent and cheap."""
    if "torchvision" in sys.modules:
        return
    try:
        importlib.import_module("torchvision")
    except Exception:  # noqa: BLE001 - any failure (RuntimeError from a torch mismatch) counts
        for name in [n for n in sys.modules if n.startswith("torchvision.")]:
            del sys.modules[name]
        sys.modules["torchvision"] = None  # find_spec and import both see "not installed"
        from transformers.utils import import_utils
        for name in ("is_torchvision_available", "is_torchvision_v2_available"):
            cached = getattr(import_utils, name, None)
            if hasattr(cached, "cache_clear"):
                cached.cache_clear()


@dataclass(frozen=True)
class VisionSpec:
    """What the model's image processor needs (its preprocessor_config.json). Travels to the
    workers inside each image's frame (protocol/frames.ImageF)."""
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, float, float] = _CLIP_MEAN
    image_std: tuple[float, float, float] = _CLIP_STD

    @classmethod
    def from_dir(cls, model_dir: Path) -> VisionSpec:
        path = Path(model_dir) / "preprocessor_config.json"
        raw = json.loads(path.read_text()) if path.exists() else {}
        size = raw.get("size") or {}
        return cls(patch_size=raw.get("patch_size", 14), merge_size=raw.get("merge_size", 2),
                   temporal_patch_size=raw.get("temporal_patch_size", 2),
                   min_pixels=raw.get("min_pixels") or size.get("shortest_edge", 56 * 56),
                   max_pixels=raw.get("max_pixels") or size.get("longest_edge", 28 * 28 * 1280),
                   image_mean=tuple(raw.get("image_mean", _CLIP_MEAN)),
                   image_std=tuple(raw.get("image_std", _CLIP_STD)))

    @cache  # noqa: B019 - a frozen spec per model: its one processor lives as long
    def processor(self):  # -> Qwen2VLImageProcessorPil
        guard_torchvision()
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )
        return Qwen2VLImageProcessorPil(
            patch_size=self.patch_size, merge_size=self.merge_size,
            temporal_patch_size=self.temporal_patch_size,
            size={"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
            image_mean=list(self.image_mean), image_std=list(self.image_std))


def takes_images(model_dir: str | Path) -> bool:
    """Whether the checkpoint in `model_dir` is run as a vision-language model (the engine
    loads its tower, the door takes images for it)."""
    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    kind = raw.get("model_type")
    return kind in VL_ARCHS or (kind in NATIVE_VL_ARCHS and "vision_config" in raw
                                and (model_dir / "preprocessor_config.json").is_file())


@cache
def model_vision(model_dir: str) -> tuple[VisionSpec, int] | None:
    """The model's image processor spec and <|image_pad|> id; None for a text model."""
    if not takes_images(model_dir):
        return None
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    return VisionSpec.from_dir(Path(model_dir)), int(raw["image_token_id"])


@dataclass(frozen=True)
class PreparedImage:
    """One image as the vision tower takes it and the text sees it."""
    pixel_values: np.ndarray  # (grid_t * grid_h * grid_w, C * temporal * patch * patch), fp32
    grid_thw: tuple[int, int, int]  # patches before the merger
    tokens: int  # placeholder (<|image_pad|>) tokens: grid_t * grid_h * grid_w / merge**2
    digest: bytes  # the encoded bytes' hash (a prefix-cache key must include it)


def decode(data: bytes, fmt: str, limits: ImageLimits, where: str = "image") -> object:
    """The image in `data` as an RGB PIL image, or an ImageError naming what is wrong."""
    from PIL import Image

    if fmt not in _MAGIC:
        raise ImageError(f"{where}: format {fmt!r} is not served (png or jpeg)")
    if len(data) > limits.max_bytes:
        raise ImageError(f"{where}: {len(data)} bytes, over image_max_bytes ({limits.max_bytes})")
    if not data.startswith(_MAGIC[fmt]):
        raise ImageError(f"{where}: the bytes are not a {fmt} file (format says {fmt!r})")
    try:
        img = Image.open(io.BytesIO(data), formats=[_PIL_FORMAT[fmt]])
        # The header gives the size before any pixel is decoded: a bomb stops here.
        width, height = img.size
        if width * height > limits.max_pixels:
            raise ImageError(f"{where}: {width}x{height} pixels, over image_max_pixels "
                             f"({limits.max_pixels})")
        img.load()
        return img.convert("RGB")
    except ImageError:
        raise
    except Image.DecompressionBombError:  # PIL's own guard, past twice its pixel default
        raise ImageError(f"{where}: too many pixels (a decompression bomb?), over "
                         f"image_max_pixels ({limits.max_pixels})") from None
    except Exception as e:  # noqa: BLE001 - PIL raises many types for one cause: a bad file
        raise ImageError(f"{where}: cannot decode the {fmt} image ({e})") from None


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int
                 ) -> tuple[int, int]:
    """transformers' Qwen2-VL smart_resize, copied: the door stays torch-free (transformers'
    image modules import torch); tests/test_vlm.py checks it equals theirs."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"absolute aspect ratio must be smaller than 200, got "
                         f"{max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_tokens(width: int, height: int, spec: VisionSpec) -> tuple[int, int, int]:
    """The (t, h, w) patch grid an image of this size becomes."""
    h, w = smart_resize(height, width, spec.patch_size * spec.merge_size, spec.min_pixels,
                        spec.max_pixels)
    return 1, h // spec.patch_size, w // spec.patch_size


@dataclass(frozen=True)
class CheckedImage:
    """An image the door decoded and checked: what the workers patchify, and its count."""
    data: bytes
    format: str
    grid_thw: tuple[int, int, int]
    tokens: int
    digest: bytes  # the encoded bytes' hash


def check(data: bytes, fmt: str, spec: VisionSpec, limits: ImageLimits,
          expected_tokens: int | None = None, where: str = "image") -> CheckedImage:
    """Decode (all of it: a truncated file fails here) and check one image chunk; no torch."""
    import hashlib

    img = decode(data, fmt, limits, where)
    try:
        grid = image_tokens(img.size[0], img.size[1], spec)
    except ImageError as e:
        raise ImageError(f"{where}: {e}") from None
    tokens = grid[0] * grid[1] * grid[2] // spec.merge_size**2
    if tokens > limits.max_tokens:
        raise ImageError(f"{where}: {tokens} image tokens, over image_max_tokens "
                         f"({limits.max_tokens})")
    if expected_tokens is not None and expected_tokens != tokens:
        raise ImageError(f"{where}: expected_tokens is {expected_tokens} but the image is "
                         f"{tokens} tokens")
    return CheckedImage(data, fmt, grid, tokens, hashlib.blake2b(data, digest_size=16).digest())


def patches(image: CheckedImage, spec: VisionSpec) -> PreparedImage:
    """The checked image's patches, by transformers' PIL image processor (in a worker)."""
    import numpy as np  # (here: the daemon's door, which imports this module, needs none)
    from PIL import Image

    rgb = Image.open(io.BytesIO(image.data), formats=[_PIL_FORMAT[image.format]]).convert("RGB")
    out = spec.processor()(images=[rgb])
    pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
    if tuple(int(x) for x in out["image_grid_thw"][0]) != image.grid_thw:
        raise ImageError(f"the image processor made a {out['image_grid_thw'][0]} grid, the "
                         f"door counted {image.grid_thw}")
    return PreparedImage(pixels, image.grid_thw, image.tokens, image.digest)


def prepare(data: bytes, fmt: str, spec: VisionSpec, limits: ImageLimits,
            expected_tokens: int | None = None, where: str = "image") -> PreparedImage:
    """Decode, check and patchify one image chunk."""
    return patches(check(data, fmt, spec, limits, expected_tokens, where), spec)


def read_pointer(location: str, limits: ImageLimits, where: str = "image") -> bytes:
    """An ImageAssetPointerChunk's bytes: only `file://` paths under `image_dir`."""
    if limits.image_dir is None:
        raise ImageError(f"{where}: image asset pointers are refused here (no image_dir is "
                         "configured); send the bytes in an ImageChunk")
    url = urlparse(location)
    if url.scheme != "file" or url.netloc not in ("", "localhost"):
        raise ImageError(f"{where}: location {location!r}: only file:// paths under "
                         "image_dir are served")
    path = Path(unquote(url.path)).resolve()
    if not path.is_relative_to(limits.image_dir):
        raise ImageError(f"{where}: location {location!r} is outside image_dir")
    try:
        size = path.stat().st_size
        if size > limits.max_bytes:
            raise ImageError(f"{where}: {size} bytes, over image_max_bytes ({limits.max_bytes})")
        return path.read_bytes()
    except OSError as e:
        raise ImageError(f"{where}: location {location!r}: {e.strerror}") from None


def check_request(images: list[CheckedImage | PreparedImage], limits: ImageLimits) -> None:
    """The per-request total of image tokens."""
    total = sum(im.tokens for im in images)
    if total > limits.request_max_tokens:
        raise ImageError(f"{total} image tokens in the request, over request_max_image_tokens "
                         f"({limits.request_max_tokens})")


def prepared_image(frame) -> PreparedImage:
    """A worker's PreparedImage from its frame (protocol/frames.ImageF)."""
    image = CheckedImage(frame.data, frame.format, tuple(frame.grid), frame.tokens, frame.digest)
    return patches(image, frame.spec)
