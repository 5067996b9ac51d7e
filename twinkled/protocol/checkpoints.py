"""Checkpoints as every layer names them: the `tinker://` path of a checkpoint, the rule its
name parts follow, and the digest that says its files are the ones written. Standard library
only."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

# checkpoint kind (path segment) -> checkpoint_type (REST field)
CHECKPOINT_TYPES = {"weights": "training", "sampler_weights": "sampler",
                    "external_weights": "external"}
CHUNK_BYTES = 1 << 20  # checkpoints can be GBs: hash them a chunk at a time


def path_part_problem(part: str) -> str | None:
    """Why `part` cannot be a component of a checkpoint's path (and directory), or None.
    The one rule: `checkpoint_path` applies it, and the door's name check
    (`engine.checks.check_name`) refuses what it refuses, so no name passes the door and
    then fails here."""
    if not part:
        return "is empty"
    if "/" in part:
        return "contains '/'"
    if ".." in part:
        return "contains '..'"
    return None


def checkpoint_path(run_id: str, kind: str, name: str) -> str:
    """``tinker://<run_id>/<kind>/<name>``; the SDK's parser needs exactly three parts."""
    if kind not in CHECKPOINT_TYPES:
        raise ValueError(f"unknown checkpoint kind {kind!r}")
    for part in (run_id, name):
        if path_part_problem(part) is not None:
            raise ValueError(f"invalid checkpoint path component {part!r}")
    return f"tinker://{run_id}/{kind}/{name}"


def checkpoint_digest(path: Path) -> tuple[int, str]:
    """(total bytes, sha256 over the directory's files in name order): for each file, its
    name, a NUL byte, then its bytes."""
    h = hashlib.sha256()
    size = 0
    for f in sorted(Path(path).iterdir(), key=lambda p: p.name):
        h.update(f.name.encode() + b"\0")
        with f.open("rb") as fh:
            while chunk := fh.read(CHUNK_BYTES):
                h.update(chunk)
                size += len(chunk)
    return size, h.hexdigest()


def fsync_path(path: Path) -> None:
    """A file's data, or a directory's entries (a rename in it), on disk: what survives a
    power loss, not only a crash of a process."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
