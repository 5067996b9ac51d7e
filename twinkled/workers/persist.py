"""Write-behind persistence of live adapters (rank 0 of the worker group).

After an optimizer step the adapter's tensors are copied to host memory (the only part on
the step's path) and a background thread writes them to `<live_dir>/<adapter id>/<version>/`
as a checkpoint directory (PEFT weights + optimizer state). Versions are nanosecond stamps,
so the newest complete one (written to a temp name, then renamed) is what a restart loads;
older versions are removed once a newer one is in place. A crash loses at most the steps
whose write had not finished.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path

from twinkled.engine.lora import Adapter
from twinkled.engine.state import Snapshot, snapshot, write_snapshot

log = logging.getLogger("twinkled.worker")


def latest_version(live_dir: Path, adapter_id: str) -> Path | None:
    """The newest complete persisted state of `adapter_id`, if any."""
    root = live_dir / adapter_id
    if not root.is_dir():
        return None
    versions = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    return versions[-1] if versions else None


class Persister:
    """Queue snapshots and write them in order, newest-wins per adapter.

    `every`: persist after every N-th optimizer step of an adapter (0: only when asked)."""

    def __init__(self, live_dir: Path, base_model: str, every: int = 1):
        self.live_dir = live_dir
        self.base_model = base_model
        self.every = every
        self._pending: dict[str, Snapshot | None] = {}  # None: forget the adapter
        self._cond = threading.Condition()
        self._busy = False
        self.written = 0
        self._thread = threading.Thread(target=self._loop, name="persist", daemon=True)
        self._thread.start()

    def after_step(self, adapter_id: str, adapter: Adapter) -> None:
        if self.every > 0 and adapter.steps % self.every == 0:
            self.save(adapter_id, adapter)

    def save(self, adapter_id: str, adapter: Adapter) -> None:
        snap = snapshot(adapter, optimizer=True)  # host copies: later steps cannot change it
        with self._cond:
            self._pending[adapter_id] = snap
            self._cond.notify()

    def forget(self, adapter_id: str) -> None:
        with self._cond:
            self._pending[adapter_id] = None
            self._cond.notify()

    def flush(self, timeout: float = 300.0) -> bool:
        """Wait until everything queued is on disk."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending:
                    self._cond.wait()
                adapter_id = next(iter(self._pending))
                snap = self._pending.pop(adapter_id)
                self._busy = True
            try:
                self._write(adapter_id, snap)
            except Exception:  # a full disk must not kill the worker; the next step retries
                log.exception("persisting adapter %s failed", adapter_id)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _write(self, adapter_id: str, snap: Snapshot | None) -> None:
        root = self.live_dir / adapter_id
        if snap is None:
            shutil.rmtree(root, ignore_errors=True)
            return
        version = root / f"{time.time_ns():020d}"
        write_snapshot(snap, version, self.base_model)
        self.written += 1
        for old in root.iterdir():
            if old != version and not old.name.startswith("."):
                shutil.rmtree(old, ignore_errors=True)
