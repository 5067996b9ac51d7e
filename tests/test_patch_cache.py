"""A worker's image patches kept by digest (workers/patch_cache.py): the same patches as
cutting each image anew, an image cut once however often it comes back, the least recently
used out under the byte budget, and a bad image failing its own op, not the warm-up."""

from __future__ import annotations

import io

import numpy as np
import pytest

from twinkled.protocol import images as im
from twinkled.protocol.frames import ImageF
from twinkled.workers.patch_cache import PatchCache


def _frame(spec: im.VisionSpec, seed: int, w: int = 90, h: int = 61) -> ImageF:
    from PIL import Image

    buf = io.BytesIO()
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    c = im.check(buf.getvalue(), "png", spec, im.ImageLimits())
    return ImageF(c.data, c.format, list(c.grid_thw), c.tokens, c.digest, spec)


@pytest.fixture(scope="module")
def spec():
    return im.VisionSpec()


def test_kept_patches_equal_fresh_ones_and_are_cut_once(spec):
    frames = [_frame(spec, s) for s in range(3)]
    cache = PatchCache()
    cache.warm(frames + frames[:1])  # (cut on the pool's threads)
    assert cache.misses == 0
    for f in frames:
        got = cache.get(f)
        np.testing.assert_array_equal(got.pixel_values, im.prepared_image(f).pixel_values)
        assert got.grid_thw == tuple(f.grid) and got.digest == f.digest
        assert cache.get(f) is got
    assert (cache.hits, cache.misses) == (6, 0)
    # the same bytes for another processor's settings are other patches
    other = _frame(im.VisionSpec(patch_size=7), 0)
    assert cache.get(other).pixel_values.shape != cache.get(frames[0]).pixel_values.shape


def test_warm_builds_each_processor_once_before_its_threads(monkeypatch):
    """A processor's first build (transformers' lazy import) is not safe to race: here a
    build that two threads enter at once fails, as the import did now and then (one image
    of a step then cut again on the step's path)."""
    import threading
    import time

    real, built, building = im.VisionSpec.processor, {}, threading.Lock()

    def processor(self):
        if self not in built:
            assert building.acquire(blocking=False), "two threads built one processor"
            time.sleep(0.05)
            built[self] = real(self)
            building.release()
        return built[self]

    monkeypatch.setattr(im.VisionSpec, "processor", processor)
    spec = im.VisionSpec(patch_size=7)
    frames = [_frame(spec, s) for s in range(4)]
    built.clear()  # (checking the frames built it: warm's threads now find none)
    cache = PatchCache()
    cache.warm(frames)
    for f in frames:
        cache.get(f)
    assert (cache.hits, cache.misses) == (4, 0)


def test_the_least_recently_used_goes_first_under_the_budget(spec):
    frames = [_frame(spec, s) for s in range(3)]
    size = im.prepared_image(frames[0]).pixel_values.nbytes
    cache = PatchCache(budget_bytes=2 * size)
    a = cache.get(frames[0])
    cache.get(frames[1])
    assert cache.get(frames[0]) is a  # (now the most recent)
    cache.get(frames[2])  # over the budget: frames[1] goes
    assert cache.get(frames[0]) is a
    misses = cache.misses
    cache.get(frames[1])
    assert cache.misses == misses + 1


def test_a_bad_image_fails_its_own_get_not_the_warm_up(spec):
    good = _frame(spec, 1)
    bad = ImageF(b"\x89PNG\r\n\x1a\n not a png", "png", good.grid, good.tokens, b"x" * 16,
                 good.spec)
    cache = PatchCache()
    cache.warm([good, bad])
    assert cache.get(good).tokens == good.tokens and cache.misses == 0
    with pytest.raises(Exception):  # noqa: B017 (PIL's own error: the op's, as without the cache)
        cache.get(bad)
