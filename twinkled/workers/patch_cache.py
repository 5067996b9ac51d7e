"""A worker's image patches, kept by the encoded image's digest.

Cutting an image into patches (decode, resize, normalise: transformers' PIL image processor)
takes ~14 ms for a 448 x 448 PNG on one core, on the step's critical path: 8 images a step
cost ~110 ms of a ~0.9 s step of a 7B VL model. The same image comes back often: an RL
group's rollouts share their prompt's image, a rollout is sampled and then trained, and an
SFT epoch repeats its data. So the patches of an image are kept, least recently used out,
under a byte budget, and a step's new images are cut on a few threads at once (PIL and
numpy release the GIL for the heavy parts).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from threading import Lock

from twinkled.protocol.frames import ImageF
from twinkled.protocol.images import PreparedImage, prepared_image

BUDGET_BYTES = 512 * 2**20  # ~100 images of 448 x 448 (4.8 MB of float32 patches each)
THREADS = 4


class PatchCache:
    def __init__(self, budget_bytes: int = BUDGET_BYTES, threads: int = THREADS):
        self.budget = budget_bytes
        self._kept: OrderedDict[tuple, PreparedImage] = OrderedDict()
        self._bytes = 0
        self._lock = Lock()  # (warm's threads put while the worker's thread gets)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="patches")
        self.hits = self.misses = 0

    def get(self, frame: ImageF) -> PreparedImage:
        """The frame's patches: kept ones, or cut now (and kept)."""
        key = _key(frame)
        with self._lock:
            got = self._kept.get(key)
            if got is not None:
                self._kept.move_to_end(key)
                self.hits += 1
                return got
        self.misses += 1
        return self._put(key, prepared_image(frame))

    def warm(self, frames: Iterable[ImageF]) -> None:
        """Cut the frames not kept yet, in parallel, so that `get` finds them all."""
        keyed = {_key(f): f for f in frames}
        with self._lock:
            todo = {k: f for k, f in keyed.items() if k not in self._kept}
        if len(todo) < 2:  # (one image: no thread hop)
            return
        try:
            for spec in {f.spec for f in todo.values()}:
                # Each model's processor is built here, once, before the threads share it:
                # its first build imports transformers' processor module, and threads racing
                # on that failed one image now and then (a miss: its op cut it again on the
                # step's path).
                spec.processor()
        except Exception:  # noqa: BLE001 (each op's own `get` meets it and fails that op alone)
            return
        for key, image in zip(todo, self._pool.map(_cut, todo.values()), strict=True):
            if image is not None:
                self._put(key, image)

    def _put(self, key: tuple, image: PreparedImage) -> PreparedImage:
        size = image.pixel_values.nbytes
        with self._lock:
            if key not in self._kept:
                self._kept[key] = image
                self._bytes += size
            while self._bytes > self.budget and len(self._kept) > 1:
                _, old = self._kept.popitem(last=False)
                self._bytes -= old.pixel_values.nbytes
        return image


def _cut(frame: ImageF) -> PreparedImage | None:
    try:
        return prepared_image(frame)
    except Exception:  # noqa: BLE001 (`get` cuts it again where its op's failure is handled)
        return None


def _key(frame: ImageF) -> tuple:
    # the encoded bytes' hash and the processor's settings: the same bytes cut for another
    # model's processor are other patches
    return frame.digest, frame.spec  # (a frozen dataclass: hashable)


PATCHES = PatchCache()  # one a worker process: its training and its sampling share it
