"""What makes an acknowledged step durable: the journal of each live adapter.

Workers persist an adapter's state behind the training loop (write-behind, `workers/
persist.py`), so a persisted version may lag what clients were told is done. The journal
closes the gap: every operation that changes an adapter (a forward_backward that trains, an
optim_step, a load) is appended, as the frame the workers ran, BEFORE its client hears it is
done. Each op carries a position (`mark`); a persisted version records the position of the
last op it contains. Restoring an adapter = its newest version + the journal's ops after
that version's mark, replayed in order. So a worker crash or a daemon SIGKILL rolls nothing
back that was acknowledged.

On disk: `<live_dir>/<adapter>/.journal`, length-prefixed msgpack records appended; rewritten
without the old records when the workers report a newer version. The page cache survives
the death of any process, but not a power loss: so (`journal_fsync`, on by default) the
executor `flush`es the journal once per step, after the step's ops are recorded and before
any of them is acknowledged: the step's writes and one fsync per file touched, in a thread
of the journal's own (the event loop keeps serving HTTP), one group commit for every op the
step acknowledges. The fsyncs of one flush run at once, each in a thread: the filesystem
commits them together (measured on the GPU machines' and this repository's CI disks: 8
adapters' journals synced one after another took 43-57 ms a step, at once about 1 ms;
`bench/bench_journal.py`). Off, the writes are made at once and nothing is fsynced.
Torch-free: the daemon's HTTP process owns it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec

from twinkled.protocol.checkpoints import fsync_path

log = logging.getLogger("twinkled")

FILE = ".journal"
_LEN = struct.Struct("<I")


class Entry(msgspec.Struct, array_like=True):
    mark: int
    frame: bytes  # an encoded workers.frames.OpF
    key: str = ""  # the id of the future that acknowledges it


class Journal:
    def __init__(self, live_dir: Path, enabled: bool = True, fsync: bool = True,
                 sync_threads: int = 8):
        self.live_dir = Path(live_dir)
        self.enabled = enabled
        self.disk = _Disk(fsync, sync_threads)
        self._entries: dict[str, list[Entry]] = {}
        self._next: dict[str, int] = {}
        self._held: dict[str, list[tuple[str, Entry]]] = {}  # pieces of an unfinished op
        self._void: set[str] = set()  # futures a crash cut short: their ops are not replayed
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(Entry)

    # -- positions ------------------------------------------------------------------------

    def reserve(self, model: str) -> int:
        """The next position of `model` (an op that changes it carries it to the workers)."""
        mark = self._next.get(model, 1)
        self._next[model] = mark + 1
        return mark

    def resume(self, model: str, mark: int) -> None:
        """After a restore at `mark`: later positions stay above it and the file's."""
        last = max([mark, *[e.mark for e in self._entries.get(model, [])]])
        self._next[model] = max(self._next.get(model, 1), last + 1)

    # -- records --------------------------------------------------------------------------

    def record(self, model: str, mark: int, frame: bytes, key: str = "") -> None:
        """An op of `model` ran and is about to be acknowledged (by future `key`)."""
        if not self.enabled:
            return
        entry = Entry(mark, frame, key)
        self._entries.setdefault(model, []).append(entry)
        self.disk.append(self._path(model), self._record(entry))

    async def flush(self) -> None:
        """Everything recorded so far is on disk (fsynced, if `journal_fsync`): await it
        before acknowledging what was recorded."""
        await self.disk.flush()

    def hold(self, key: str, model: str, mark: int, frame: bytes) -> None:
        """A piece of an op cut between steps: recorded only once its last piece ran."""
        if self.enabled:
            self._held.setdefault(key, []).append((model, Entry(mark, frame, key)))

    def commit(self, key: str) -> None:
        for model, e in self._held.pop(key, []):
            self.record(model, e.mark, e.frame, key)

    def void(self, keys: set[str]) -> None:
        """At start-up: these futures were pending when the daemon died, and their clients
        are told to submit them again, so their ops (recorded, never acknowledged) must
        not be replayed too."""
        self._void |= keys

    def drop(self, key: str) -> None:
        self._held.pop(key, None)

    def since(self, model: str, mark: int) -> list[Entry]:
        """The ops of `model` after position `mark`, in order."""
        return [e for e in self._entries.get(model, []) if e.mark > mark
                and not (e.key and e.key in self._void)]

    def persisted(self, model: str, mark: int) -> None:
        """The workers wrote a version of `model` holding everything up to `mark`."""
        entries = self._entries.get(model)
        if not entries or entries[0].mark > mark:
            return
        keep = [e for e in entries if e.mark > mark]
        self._entries[model] = keep
        self._rewrite(model, keep)

    def discard_after(self, model: str, mark: int) -> None:
        """Drop the ops after `mark` (they could not be replayed; the run goes on without)."""
        keep = [e for e in self._entries.get(model, []) if e.mark <= mark]
        self._entries[model] = keep
        self._rewrite(model, keep)

    def forget(self, model: str) -> None:
        """The adapter is gone (its session ended): nothing to replay any more."""
        self._entries.pop(model, None)
        self._next.pop(model, None)
        self.disk.replace(self._path(model), None)

    def release(self, model: str) -> None:
        """The adapter went to another lane, whose journal goes on with its file: forget
        what this one knew of it (were it to come back, its file is read again)."""
        self._entries.pop(model, None)
        self._next.pop(model, None)

    # -- disk -----------------------------------------------------------------------------

    def loaded(self, model: str) -> bool:
        return model in self._entries

    def load(self, model: str) -> None:
        """Read `model`'s journal file (at start-up, before its adapter is restored)."""
        path = self._path(model)
        entries: list[Entry] = []
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raw = b""
        at = 0
        while at + _LEN.size <= len(raw):
            (n,) = _LEN.unpack_from(raw, at)
            try:
                entries.append(self._dec.decode(raw[at + _LEN.size: at + _LEN.size + n]))
            except msgspec.DecodeError:  # a torn last record: what came before stands
                log.warning("journal of %s ends in a torn record; ignored", model)
                break
            at += _LEN.size + n
        self._entries[model] = entries
        if entries:
            self._next[model] = max(self._next.get(model, 1), entries[-1].mark + 1)

    def _rewrite(self, model: str, entries: list[Entry]) -> None:
        data = b"".join(self._record(e) for e in entries)
        self.disk.replace(self._path(model), data or None)

    def _record(self, entry: Entry) -> bytes:
        data = self._enc.encode(entry)
        return _LEN.pack(len(data)) + data

    def _path(self, model: str) -> Path:
        return self.live_dir / model / FILE


class _Disk:
    """The journal's file operations, in order. Without fsync they are made at once. With
    it they wait for `flush`, which makes them and then fsyncs each file they touched (and
    each directory whose entries changed) in one thread of its own: so one step's records
    share one fsync per file, and the event loop never waits on the disk. Those fsyncs run
    in up to `sync_threads` threads at once (1: one after another, the reference)."""

    def __init__(self, fsync: bool, sync_threads: int = 8):
        self.fsync = fsync
        self._todo: list[tuple[Path, bytes | None, bool]] = []  # (path, data, append?)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="journal") if fsync else None
        self._syncers = (ThreadPoolExecutor(sync_threads, thread_name_prefix="journal-sync")
                         if fsync and sync_threads > 1 else None)
        self.syncs = 0  # fsync calls made (tests, benchmarks)

    def append(self, path: Path, data: bytes) -> None:
        self._do([(path, data, True)])

    def replace(self, path: Path, data: bytes | None) -> None:
        """The file's whole content (None: remove it)."""
        self._do([(path, data, False)])

    def _do(self, ops: list[tuple[Path, bytes | None, bool]]) -> None:
        if self.fsync:
            self._todo.extend(ops)
        else:
            self._write(ops)

    async def flush(self) -> None:
        if not self._todo:
            return
        ops, self._todo = self._todo, []
        await asyncio.get_running_loop().run_in_executor(self._thread, self._write, ops)

    def _write(self, ops: list[tuple[Path, bytes | None, bool]]) -> None:
        files: set[Path] = set()
        dirs: set[Path] = set()
        for path, data, append in ops:
            if data is None:
                # missing_ok: a model unloaded for good has its whole live folder removed by
                # the worker's persister too, at the same time (seen: the demo's last step
                # failed on this unlink).
                path.unlink(missing_ok=True)
                dirs.add(path.parent)
                files.discard(path)
                continue
            if not path.parent.is_dir():
                path.parent.mkdir(parents=True, exist_ok=True)
                dirs.add(path.parent.parent)
            if append:
                if not path.exists():
                    dirs.add(path.parent)
                with open(path, "ab") as f:
                    f.write(data)
                files.add(path)
                continue
            tmp = path.with_name(FILE + ".tmp")
            with open(tmp, "wb") as f:
                f.write(data)
                if self.fsync:  # a rename of an unsynced file may leave it empty
                    os.fsync(f.fileno())
                    self.syncs += 1
            os.replace(tmp, path)
            files.discard(path)
            dirs.add(path.parent)
        if self.fsync:
            paths = [*files, *dirs]
            synced = (map(_sync, paths) if self._syncers is None or len(paths) < 2
                      else self._syncers.map(_sync, paths))
            self.syncs += sum(synced)


def _sync(path: Path) -> bool:
    try:
        fsync_path(path)
    except FileNotFoundError:  # removed with its model's folder: nothing to keep
        return False
    return True

