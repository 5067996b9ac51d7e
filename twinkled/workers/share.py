"""Rank 0's files for every rank, when the group spans hosts.

A restore, a checkpoint load and a sampler load read a directory under the daemon's data
dir. Local ranks share that disk; a rank on another host does not, and one that read its
own (missing or stale) copy would silently hold other weights than its replicas. So when
the group spans hosts, rank 0 (always on the daemon's host) reads the directory and
broadcasts its files over torch.distributed; the other ranks load a private temporary
copy. Collective: every rank calls it, in the same order (barrier ops run on every rank).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch.distributed as dist

from twinkled.protocol.blobs import Blobs, is_remote

log = logging.getLogger("twinkled.worker")


def _read(path: Path | None) -> dict[str, bytes] | str | None:
    if path is None or not path.is_dir():
        return None
    try:
        return {str(f.relative_to(path)): f.read_bytes() for f in path.rglob("*")
                if f.is_file()}
    except OSError as e:  # said to every rank, so none waits for files that never come
        return f"rank 0 could not read {path}: {e}"


def readable(blobs: Blobs, locator: str | Path | None, rank: int, spans_hosts: bool):
    """A context yielding a checkpoint's (or persisted state's) directory as this rank can
    read it: an object store's version fetched into this host's cache by every rank for
    itself (no collective); a directory itself, or rank 0's copy when the group spans
    hosts (`rank0_dir`). The same on every rank, as the locator is."""
    if locator is not None and is_remote(str(locator)):
        return nullcontext(blobs.local(str(locator)))
    if spans_hosts:
        return rank0_dir(locator, rank)
    return nullcontext(None if locator is None else Path(locator))


@contextmanager
def rank0_dir(path: str | Path | None, rank: int):
    """Yields rank 0's `path` on rank 0, and a copy of it on the others (None where rank 0
    has no such directory); the copy is removed afterwards."""
    payload = [_read(Path(path)) if rank == 0 and path is not None else None]
    dist.broadcast_object_list(payload, src=0)
    files = payload[0]
    if isinstance(files, str):
        raise OSError(files)
    if rank == 0 or files is None:
        yield (Path(path) if files is not None else None)
        return
    copy = Path(tempfile.mkdtemp(prefix="twinkled-share-"))
    try:
        for name, data in files.items():
            target = copy / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        log.info("%d file(s) of %s from rank 0", len(files), path)
        yield copy
    finally:
        shutil.rmtree(copy, ignore_errors=True)
