"""Write-behind persistence of live adapters (rank 0 of the worker group).

An optimizer step only marks its adapter changed. Between steps, when the writer thread
has finished its last batch, the changed adapters are snapshotted (one device copy each,
brought to host memory on a side stream) and the thread writes them to
`<live_dir>/<adapter id>/<version>/` (weights + optimizer state, `engine/live.py`). Versions are nanosecond stamps,
so the newest complete one (written to a temp name, then renamed) is what a restart loads;
older versions are removed once a newer one is in place. Each version records the journal
position of the last operation it holds; the daemon replays its journal from there, so a
crash loses nothing acknowledged (`twinkled/core/journal.py`).

A version written between steps may hold a step the daemon never acknowledged: another rank
died on it (data parallelism), or the daemon died before journaling it. So it is written
under a hidden name (`.t<stamp>`, which a restore does not see) and takes its real name
only when the next step arrives (`confirm`): the daemon sends a step only after it has
journaled (or failed) every op of the one before. Until then the older version stays, and
the daemon's journal keeps the ops after it (it hears of a version only once confirmed).
A version written inside a step that changes nothing (an idle unload, a hot restart's
persist) holds only acknowledged steps and is written under its real name at once.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path

from twinkled.engine.live import write_live
from twinkled.engine.lora import Adapter
from twinkled.engine.state import Snapshot, snapshot
from twinkled.protocol.checkpoints import fsync_path

from .rank_io import anywhere

log = logging.getLogger("twinkled.worker")
# Fault tests only: the writer waits this long before each write, so a crash falls between
# an acknowledged op and the version holding it (what only the journal then covers).
_TEST_DELAY = float(os.environ.get("TWINKLED_TEST_PERSIST_DELAY", "0"))


HIDDEN = ".t"  # the name prefix of a version not yet confirmed (see the module's docstring)
# The writer keeps the disk busy at most this share of the time: after a write that took
# W seconds it rests W * (1 / DUTY - 1) before the next (a flush does not wait). Written
# back to back, Qwen3.5-9B's eight 1 GiB adapter states (weights and moments) saturated the
# disk, and the journal's fsync before each answer waited behind them: 3-6 s stalls between
# 0.65 s steps. A rest only makes versions further apart; the journal covers the steps
# between (a restart replays more of them).
DUTY = 0.25



def latest_version(live_dir: Path, adapter_id: str) -> Path | None:
    """The newest complete persisted state of `adapter_id`, if any."""
    root = live_dir / adapter_id
    if not root.is_dir():
        return None
    versions = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    return versions[-1] if versions else None


class Persister:
    """Remember which adapters changed; snapshot and write them when the writer is free.

    `mark` is all a step pays. `pump` (called by the worker between steps) snapshots the
    changed adapters only when the previous batch is on disk, so a fast training loop
    coalesces into as many writes as the disk can take, each of the newest state.
    `every`: persist after every N-th optimizer step of an adapter (0: only when asked)."""

    def __init__(self, live_dir: Path, every: int = 1):
        self.live_dir = live_dir
        self.every = every
        self.dirty: dict[str, None] = {}  # changed, oldest first (no adapter starves)
        # Snapshots taken when the adapter changed (`hold`: tensor-parallel adapters, whose
        # gathering is a collective), with their journal marks; written instead of a new one.
        self.ready: dict[str, tuple[Snapshot, int]] = {}
        # (adapter, snapshot or None to forget it, journal mark of the snapshot, final?);
        # ("", None, 0, True): confirm the hidden versions written so far
        self._queue: list[tuple[str, Snapshot | None, int, bool]] = []
        self._hidden: dict[str, tuple[Path, int]] = {}  # adapter -> unconfirmed version, mark
        self._unconfirmed = 0  # hidden versions queued since the last `confirm`
        self._written: dict[str, int] = {}  # adapter -> mark, since `take_written`
        self._cond = threading.Condition()
        self._busy = False
        self._rest_until = 0.0  # monotonic time before which `pump` hands nothing (DUTY)
        self.written = 0
        self._thread = threading.Thread(target=self._loop, name="persist", daemon=True)
        self._thread.start()

    def after_step(self, adapter_id: str, adapter: Adapter) -> None:
        if self.every > 0 and adapter.steps % self.every == 0:
            self.dirty.setdefault(adapter_id)

    def mark(self, adapter_id: str) -> None:
        self.dirty.setdefault(adapter_id)

    def hold(self, adapter_id: str, snap: Snapshot, mark: int) -> None:
        """A snapshot made by the caller (a tensor-parallel one), to write as `mark`."""
        self.ready[adapter_id] = (snap, mark)
        self.dirty.setdefault(adapter_id)

    def free(self) -> bool:
        """Nothing waits to be written: a new snapshot would go to the disk at once."""
        return not self.dirty and self.idle() and not self._resting()

    def _resting(self) -> bool:
        """The writer rests after its last write (DUTY)."""
        return time.monotonic() < self._rest_until

    def forget(self, adapter_id: str) -> None:
        self.dirty.pop(adapter_id, None)
        self.ready.pop(adapter_id, None)
        with self._cond:
            self._queue.append((adapter_id, None, 0, True))
            self._cond.notify()

    def confirm(self) -> None:
        """A new step arrived: every step before it was acknowledged (or failed, with the
        ops journaled or not), so the versions written so far may take their real names."""
        if not self._unconfirmed:
            return
        self._unconfirmed = 0
        with self._cond:
            self._queue.append(("", None, 0, True))
            self._cond.notify()

    def idle(self) -> bool:
        with self._cond:
            return not self._queue and not self._busy

    def take_written(self) -> dict[str, int]:
        """{adapter: journal mark} of the versions written since the last call."""
        with self._cond:
            written, self._written = self._written, {}
        return written

    def pump(self, adapters: dict[str, Adapter], marks: dict[str, int],
             limit: int | None = 1, final: bool = False) -> None:
        """Hand up to `limit` changed adapters to the writer, if it is free. One at a time
        between steps keeps the snapshot's host time off the next step's start. `marks`:
        each adapter's journal position as of its state without pending gradients."""
        if not self.dirty or not self.idle() or (not final and self._resting()):
            return
        chosen = list(self.dirty)[:limit]
        for a in chosen:
            del self.dirty[a]
        snaps = [self.ready.pop(a, None) for a in chosen]
        snaps = [(a, *held, final) if held is not None else
                 (a, snapshot(adapters[a], optimizer=True), marks.get(a, 0), final)
                 for a, held in zip(chosen, snaps, strict=True) if held is not None or a in adapters]
        if not final:
            self._unconfirmed += len(snaps)
        with self._cond:
            self._queue.extend(snaps)
            self._cond.notify()

    def flush(self, adapters: dict[str, Adapter], marks: dict[str, int],
              timeout: float = 300.0) -> bool:
        """Everything changed is on disk when this returns True."""
        deadline = time.monotonic() + timeout
        self.confirm()  # asked inside a step (see above): the steps before were answered
        if not self._wait_idle(deadline):
            return False
        self.pump(adapters, marks, limit=None, final=True)
        return self._wait_idle(deadline)

    def _wait_idle(self, deadline: float) -> bool:
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                adapter_id, snap, mark, final = self._queue.pop(0)
                self._busy = True
            try:
                if adapter_id:
                    time.sleep(_TEST_DELAY)
                    began = time.monotonic()
                    self._write(adapter_id, snap, mark, final)
                    ended = time.monotonic()
                    self._rest_until = ended + (ended - began) * (1 / DUTY - 1)
                else:
                    self._confirm()
            except Exception:  # a full disk must not kill the worker; the next step retries
                log.exception("persisting adapter %s failed", adapter_id)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _write(self, adapter_id: str, snap: Snapshot | None, mark: int, final: bool) -> None:
        root = self.live_dir / adapter_id
        if snap is None:
            self._hidden.pop(adapter_id, None)
            shutil.rmtree(root, ignore_errors=True)
            return
        stamp = f"{time.time_ns():020d}"
        version = root / (stamp if final else HIDDEN + stamp)
        write_live(snap, version, mark)
        self.written += 1
        if final:
            self._hidden.pop(adapter_id, None)
            self._landed(adapter_id, version, mark)
            return
        old = self._hidden.get(adapter_id)
        if old is not None:  # never confirmed, and newer state is here
            shutil.rmtree(old[0], ignore_errors=True)
        self._hidden[adapter_id] = (version, mark)

    def _confirm(self) -> None:
        hidden, self._hidden = self._hidden, {}
        for adapter_id, (path, mark) in hidden.items():
            version = path.with_name(path.name.removeprefix(HIDDEN))
            try:
                path.rename(version)
                fsync_path(version.parent)
            except OSError:  # removed meanwhile: the older version stands
                log.exception("confirming the persisted state of %s failed", adapter_id)
                continue
            self._landed(adapter_id, version, mark)

    def _landed(self, adapter_id: str, version: Path, mark: int) -> None:
        """`version` is the adapter's newest acknowledged state: the daemon hears of it,
        older versions go."""
        with self._cond:
            self._written[adapter_id] = mark
        for old in version.parent.iterdir():
            if old != version and old.is_dir() and (not old.name.startswith(".")
                                                    or old.name.startswith(HIDDEN)):
                shutil.rmtree(old, ignore_errors=True)


class SplitPersistence:
    """Write-behind persistence of tensor-parallel adapters, kept by every rank alike.

    A split adapter is gathered whole to be written, and the gather is a collective, so
    every rank of the worker group must take the same snapshots at the same point of the
    same step. Every rank keeps the same list of changed adapters (the ops, and so the
    step counts, are the same on all ranks). At the end of a step with something changed,
    rank 0 says whether its writer is free (one all-reduce of one number); if it is, the
    oldest changed adapter is gathered by the tensor-parallel group that holds rank 0 and
    handed to the writer. So, as for unsplit adapters (`Persister.pump`), a fast loop
    coalesces into as many writes as the disk takes, and a step never gathers an
    adapter's GiBs of state just because it stepped (a 70B's state with its moments)."""

    def __init__(self, engine, persister: Persister | None, every: int, replica: int):
        self.engine = engine
        self.persister = persister  # rank 0 only
        self.every = every  # persist_every: after every N-th optimizer step (0: when asked)
        self.writes = replica == 0  # the group holding rank 0 gathers; the others skip
        self.dirty: dict[str, None] = {}

    def stepped(self, adapter_id: str) -> None:
        steps = self.engine.pool.get(adapter_id).steps
        if self.every > 0 and steps % self.every == 0:
            self.dirty.setdefault(adapter_id)

    def changed(self, adapter_id: str) -> None:
        self.dirty.setdefault(adapter_id)

    def forget(self, adapter_id: str) -> None:
        self.dirty.pop(adapter_id, None)

    def now(self, adapter_id: str, mark: int) -> None:
        """Gather `adapter_id` now (asked to persist: every rank calls this)."""
        self.dirty.pop(adapter_id, None)
        if self.writes:
            snap = self.engine.snapshot(adapter_id)
            if self.persister is not None:
                self.persister.hold(adapter_id, snap, mark)

    def pump(self, marks: dict[str, int]) -> None:
        """At the end of a step, on every rank: gather one changed adapter if rank 0's
        writer is free."""
        if not self.dirty or not self._writer_free():
            return
        adapter_id = next(iter(self.dirty))
        if self.engine.has_adapter(adapter_id):
            self.now(adapter_id, marks.get(adapter_id, 0))
        else:
            self.dirty.pop(adapter_id)

    def _writer_free(self) -> bool:
        """Rank 0's word (the other ranks have no writer and say no)."""
        free = self.persister is not None and self.persister.free()
        return anywhere(free, self.engine.model.device)
