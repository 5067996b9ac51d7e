"""Where checkpoint files live (``checkpoint_store``), for every process that touches them.

A checkpoint's row (store/checkpoints.py) names its files by a *locator* in its ``dir``
column, and everything that writes, reads, verifies, downloads or deletes those files goes
through `Blobs`, which acts on the locator's kind, not on the configured store (so rows
saved before the store changed stay readable):

- a path: a directory on a file system this process sees: the data dir
  (``<data_dir>/checkpoints``, the default) or a shared one (NFS-style, mounted at the same
  path on every host). The engine writes it in place, atomically (temporary directory,
  fsync, rename: engine/state.py), and readers read it directly.
- ``s3://bucket/prefix/...``: an S3-compatible object store, through fsspec (s3fs, the
  ``s3`` extra; credentials from the standard AWS variables and files; ``endpoint`` for
  MinIO-like stores, else ``AWS_ENDPOINT_URL_S3``). A save writes the files to a local
  staging directory, digests them, uploads them under ``<base>/<sha256>/`` and only then
  answers, so the row the head writes on that answer never names files still uploading;
  a half upload sits under a digest no ready row names. Readers fetch a version into a
  local cache keyed by its digest (checked on arrival) and read that.

A save's locator (``SaveF.dir``, the row while it is written) is the *base*; the row of a
finished save holds `versioned(base, sha256)`: the base itself for a path, the digest's
folder under it for an object store (both sides derive it, so no frame carries it).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from twinkled.protocol.checkpoints import checkpoint_digest

log = logging.getLogger("twinkled.checkpoints")
CACHE_KEEP = 8  # fetched versions kept in a cache dir (a load reads them into memory)
_STAGING = ".staging"
_REMOTE = ("s3://",)
_FALLBACK_CACHE = Path(tempfile.gettempdir()) / "twinkled-checkpoint-cache"


def is_remote(locator: str) -> bool:
    """Whether a locator names objects in a store rather than a directory."""
    return locator.startswith(_REMOTE)


def versioned(base: str, sha256: str) -> str:
    """The locator a finished save's row holds (see the module's docstring)."""
    return f"{base.rstrip('/')}/{sha256}" if is_remote(base) else base


def unversioned(locator: str) -> str:
    """The base a version's locator was saved under (`versioned` undone)."""
    return locator.rstrip("/").rpartition("/")[0] if is_remote(locator) else locator


def store_spec(config) -> dict:
    """The configured store as a worker rank gets it in its options (`Blobs.from_spec`)."""
    data = Path(config.data_dir)
    return {"root": config.checkpoint_store or str(data / "checkpoints"),
            "cache_dir": str(data / "checkpoint-cache"),
            "endpoint": config.checkpoint_store_endpoint}


class StoreError(OSError):
    """The checkpoint store failed (unreachable, refused, missing objects): said plainly,
    with the locator, in place of the client library's own exception types."""


class Blobs:
    """Checkpoint files by locator. `root`: where new checkpoints go ("" or a path: a
    directory; ``s3://bucket/prefix``: an object store); `cache_dir`: where fetched
    versions and a save's staging directory live on this host; `endpoint`: the object
    store's URL where it is not AWS's."""

    def __init__(self, root: str | Path, cache_dir: str | Path, endpoint: str = ""):
        self.root = str(root).rstrip("/")
        self.cache_dir = Path(cache_dir)
        self.endpoint = endpoint
        self._fs_lock = threading.Lock()
        self._fs = None
        self._background = ThreadPoolExecutor(1, thread_name_prefix="blobs")
        if is_remote(self.root):
            self.fs()  # a missing s3fs or a bad option fails at start-up, by name

    @classmethod
    def from_config(cls, config) -> Blobs:
        """The daemon's store (`Config.checkpoint_store`, `checkpoint_store_endpoint`)."""
        return cls.from_spec(store_spec(config))

    @classmethod
    def from_spec(cls, spec: dict | None) -> Blobs:
        """A worker's store (`store_spec`; None: a default one caching in a temporary dir)."""
        spec = spec or {}
        cache = Path(spec.get("cache_dir") or _FALLBACK_CACHE)
        return cls(spec.get("root") or cache / "checkpoints", cache, spec.get("endpoint", ""))

    def _staging(self) -> Path:
        """A new private directory in the cache dir for a save or a fetch to fill. A rank
        on another host may not be able to create the head's cache dir: it caches under
        its temporary directory instead."""
        try:
            (self.cache_dir / _STAGING).mkdir(parents=True, exist_ok=True)
        except OSError:
            self.cache_dir = _FALLBACK_CACHE
            (self.cache_dir / _STAGING).mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(dir=self.cache_dir / _STAGING))

    # -- the object store -----------------------------------------------------------------

    def fs(self):
        """The fsspec file system of the object store (made once, on first use)."""
        with self._fs_lock:
            if self._fs is None:
                try:
                    import s3fs
                except ImportError:
                    raise ValueError("checkpoint_store: an s3:// store needs s3fs: install "
                                     "twinkle with the s3 extra (pip install 'twinkle[s3]')"
                                     ) from None
                # Listings are not cached: another host's upload or delete is seen at once.
                self._fs = s3fs.S3FileSystem(endpoint_url=self.endpoint or None,
                                             use_listings_cache=False)
            return self._fs

    def _key(self, locator: str) -> str:
        return locator.removeprefix("s3://").rstrip("/")

    def _remote(self, what: str, locator: str, call: Callable):
        try:
            return call()
        except FileNotFoundError:
            raise
        except Exception as e:  # botocore's and aiohttp's own types: one error, with where
            raise StoreError(f"checkpoint store: {what} {locator} failed: "
                             f"{type(e).__name__}: {e}") from e

    # -- what the callers use -------------------------------------------------------------

    def base(self, run_id: str, kind: str, name: str) -> str:
        """Where a new save of checkpoint run_id/kind/name goes (parts checked by
        `checkpoint_path` before)."""
        return f"{self.root}/{run_id}/{kind}/{name}"

    def save(self, base: str, write: Callable[[Path], object]) -> tuple[int, str]:
        """Write a checkpoint with `write(directory)` and make it the files of `base`'s
        version; returns (bytes, sha256) once they are all where readers find them."""
        if not is_remote(base):
            write(Path(base))
            return checkpoint_digest(Path(base))
        tmp = self._staging()
        try:
            write(tmp / "files")
            size, sha = checkpoint_digest(tmp / "files")
            self._upload(tmp / "files", versioned(base, sha))
            self._keep(tmp / "files", sha)  # a load of it on this host needs no download
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return size, sha

    def _upload(self, local: Path, locator: str) -> None:
        fs, key = self.fs(), self._key(locator)
        files = {f.name: f.stat().st_size for f in local.iterdir()}
        try:
            if self.files(locator) == files:
                return  # the same digest is there in full already (identical weights)
        except FileNotFoundError:
            pass
        try:
            for name in sorted(files):
                self._remote("uploading to", locator,
                             lambda n=name: fs.put_file(str(local / n), f"{key}/{n}"))
        except StoreError:
            self.delete(locator, quiet=True)  # no half version left behind, where we can
            raise

    def files(self, locator: str) -> dict[str, int]:
        """{file name: bytes} of a checkpoint; FileNotFoundError if it has none."""
        if not is_remote(locator):
            return {p.name: p.stat().st_size for p in sorted(Path(locator).iterdir())
                    if p.is_file() and not p.name.startswith(".")}
        entries = self._remote("listing", locator,
                               lambda: self.fs().ls(self._key(locator), detail=True))
        found = {e["name"].rpartition("/")[2]: int(e["size"]) for e in entries
                 if e.get("type") == "file"}
        if not found:
            raise FileNotFoundError(f"no objects under {locator}")
        return found

    def local(self, locator: str) -> Path:
        """A local directory holding the checkpoint's files: the directory itself, or the
        cached copy of an object store's version (fetched and its digest checked first)."""
        if not is_remote(locator):
            return Path(locator)
        sha = locator.rstrip("/").rpartition("/")[2]
        cached = self.cache_dir / sha
        if cached.is_dir():
            os.utime(cached)  # recently used: kept longest
            return cached
        tmp = self._staging()
        try:
            fs, key = self.fs(), self._key(locator)
            for name in self.files(locator):
                self._remote("fetching", locator,
                             lambda n=name: fs.get_file(f"{key}/{n}", str(tmp / n)))
            got = checkpoint_digest(tmp)[1]
            if got != sha:
                raise StoreError(f"checkpoint store: {locator} holds other files than "
                                 f"were saved (sha256 {got[:12]}..)")
            return self._keep(tmp, sha)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _keep(self, directory: Path, sha: str) -> Path:
        """`directory` (written or fetched) as the cache's copy of version `sha`."""
        cached = self.cache_dir / sha
        try:
            directory.rename(cached)
        except OSError:  # another rank of this host put it there first: the same files
            if not cached.is_dir():
                raise
        self._prune()
        return cached

    def _prune(self) -> None:
        """The cache keeps its CACHE_KEEP most recently used versions."""
        try:
            kept = sorted((p for p in self.cache_dir.iterdir()
                           if p.is_dir() and not p.name.startswith(".")),
                          key=lambda p: p.stat().st_mtime, reverse=True)
        except OSError:
            return
        for old in kept[CACHE_KEEP:]:
            shutil.rmtree(old, ignore_errors=True)

    def digest(self, locator: str) -> tuple[int, str]:
        """(bytes, sha256) of a checkpoint as stored now. An object store's version is
        named by its digest and checked when fetched: its listing (sizes) is what is
        checked here, without downloading every checkpoint at each start."""
        if not is_remote(locator):
            return checkpoint_digest(Path(locator))
        return sum(self.files(locator).values()), locator.rstrip("/").rpartition("/")[2]

    def delete(self, locator: str, quiet: bool = False) -> None:
        """Remove a checkpoint's files (nothing if there are none). `quiet`: a failure is
        logged, not raised."""
        try:
            if not is_remote(locator):
                shutil.rmtree(locator, ignore_errors=True)
                return
            try:
                self._remote("deleting", locator,
                             lambda: self.fs().rm(self._key(locator), recursive=True))
            except FileNotFoundError:
                pass
        except StoreError:
            if not quiet:
                raise
            log.exception("could not delete checkpoint files at %s", locator)

    def delete_later(self, locator: str) -> None:
        """`delete`, in a thread of its own: for callers on the event loop that need not
        wait (an expired checkpoint, the version a newer save replaced)."""
        self._background.submit(self.delete, locator, True)
