"""Checkpoint integrity: recompute each ready checkpoint's digest and set damaged ones aside.

Run at daemon start-up and on demand (`twinkled ctl checkpoints verify`). Standard library
and the store only (no torch), so it is cheap to import from the CLI.

A checkpoint is damaged when its directory is missing, cannot be read, or its size or
sha256 differ from what was recorded when it was written. Its directory (if any) is moved
to ``<data_dir>/quarantine/<timestamp>-<name>`` -- never deleted, an admin decides -- and
its row is marked corrupt with the reason, so it is no longer listed or served. In an
object store (protocol/blobs.py) a version's objects are checked by their listing (present,
sizes; the digest is checked on every fetch), and are left where they are; a store that
cannot be reached damages nothing: it is logged and the check is skipped.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from twinkled.protocol.blobs import Blobs, StoreError, is_remote
from twinkled.store import Row, Store

log = logging.getLogger("twinkled")



def all_checkpoints(store: Store, status: str | None = None, run_id: str | None = None,
                    tenant: str | None = None) -> list[Row]:
    """Every checkpoint matching the filters (status None: any), newest first."""
    rows: list[Row] = []
    while True:
        page, total = store.checkpoints.list(run_id=run_id, tenant=tenant, status=status,
                                             offset=len(rows), limit=500)
        rows.extend(page)
        if not page or len(rows) >= total:
            return rows


def offline_blobs(data_dir: Path) -> Blobs:
    """The checkpoint files as `twinkled ctl` reaches them without a daemon: a row's
    locator says where (an object store's endpoint from AWS_ENDPOINT_URL_S3)."""
    data_dir = Path(data_dir)
    return Blobs(data_dir / "checkpoints", data_dir / "checkpoint-cache")


def _short(digest: str) -> str:
    return digest[:12] + ".."


def _problem(row: Row, blobs: Blobs) -> str | None:
    """What is wrong with a ready checkpoint's files, or None if they are intact (or the
    store holding them cannot be reached now)."""
    try:
        if not is_remote(row["dir"]) and not Path(row["dir"]).exists():
            return f"missing directory {row['dir']}"
        size, sha = blobs.digest(row["dir"])
    except FileNotFoundError:
        return f"missing files at {row['dir']}"
    except StoreError as e:
        log.warning("checkpoint %s not verified: %s", row["tinker_path"], e)
        return None
    except OSError as e:
        return f"unreadable: {e}"
    if size != row["size_bytes"]:
        return f"size mismatch: expected {row['size_bytes']} bytes, found {size}"
    if sha != row["sha256"]:
        return f"sha256 mismatch: expected {_short(row['sha256'])}, found {_short(sha)}"
    return None


def _quarantine(directory: Path, data_dir: Path) -> Path:
    """Move directory to ``<data_dir>/quarantine/<timestamp>-<name>`` (suffixed if taken)."""
    root = Path(data_dir) / "quarantine"
    root.mkdir(parents=True, exist_ok=True)
    stem = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{directory.name}"
    dest, n = root / stem, 1
    while dest.exists() or dest.is_symlink():
        dest, n = root / f"{stem}-{n}", n + 1
    shutil.move(str(directory), str(dest))
    return dest


def verify_checkpoints(store: Store, data_dir: Path, blobs: Blobs | None = None) -> list[dict]:
    """Check every ready checkpoint against its recorded size and sha256 (`blobs`: where
    the files are, the data dir's default store if None).

    Damaged ones are moved to ``<data_dir>/quarantine/`` and marked corrupt with the reason;
    returns one ``{"tinker_path", "reason", "moved_to"}`` per damaged checkpoint (moved_to
    is None when there was nothing to move or the move failed)."""
    damaged = []
    blobs = blobs or offline_blobs(data_dir)
    for row in all_checkpoints(store, status="ready"):
        if row["sha256"] is None or row["size_bytes"] is None:
            continue  # nothing recorded to check against
        problem = _problem(row, blobs)
        if problem is None:
            continue
        path = row["tinker_path"]
        # Saved again or deleted while we were reading it (a running daemon): not ours.
        current = store.checkpoints.get(path)
        if current is None or any(current[k] != row[k] for k in
                                  ("status", "sha256", "size_bytes", "created", "dir")):
            continue
        directory, moved_to, reason = Path(row["dir"]), None, problem
        try:
            if not is_remote(row["dir"]) and (directory.exists() or directory.is_symlink()):
                moved_to = _quarantine(directory, data_dir)
                reason = f"{problem}; moved to {moved_to}"
        except OSError as e:
            reason = f"{problem}; could not move it aside: {e}"
        if not store.checkpoints.mark_corrupt(path, reason):
            continue  # the row went away meanwhile
        log.warning("checkpoint %s is damaged and was marked corrupt: %s", path, reason)
        damaged.append({"tinker_path": path, "reason": reason,
                        "moved_to": None if moved_to is None else str(moved_to)})
    return damaged
