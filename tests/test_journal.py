"""The journal of acknowledged ops is fsynced before they are acknowledged (issue 28 item
12): one group commit per step (one fsync per file the step touched, however many ops it
recorded), made off the event loop; `journal_fsync = false` turns it off."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from twinkled.core.journal import Journal
from twinkled.protocol.config import Config, check_config


@pytest.fixture()
def fsyncs(monkeypatch):
    """Every real os.fsync call: (path it synced, thread it ran in)."""
    calls, real = [], os.fsync

    def recording(fd):
        calls.append((os.readlink(f"/proc/self/fd/{fd}"), threading.get_ident()))
        return real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    return calls


def _step(journal: Journal, ops: list[tuple[str, int]]) -> None:
    for model, mark in ops:
        journal.record(model, mark, b"op %d" % mark)
    asyncio.run(journal.flush())


def test_a_step_is_fsynced_once_per_file_off_the_event_loop(tmp_path, fsyncs):
    journal = Journal(tmp_path)
    _step(journal, [("a", 1), ("a", 2), ("b", 1), ("a", 3), ("b", 2)])
    files = {str(tmp_path / m / ".journal") for m in ("a", "b")}
    assert files <= {p for p, _ in fsyncs}
    assert all(thread != threading.get_ident() for _, thread in fsyncs)
    fsyncs.clear()
    _step(journal, [("a", 4), ("b", 3), ("b", 4), ("a", 5)])
    assert sorted(p for p, _ in fsyncs) == sorted(files)  # one each: a group commit

    fresh = Journal(tmp_path)  # what a restart reads
    for model, marks in (("a", [1, 2, 3, 4, 5]), ("b", [1, 2, 3, 4])):
        fresh.load(model)
        assert [e.mark for e in fresh.since(model, 0)] == marks


def test_the_files_of_one_step_are_fsynced_at_once_and_all_before_the_flush_ends(
        tmp_path, monkeypatch):
    """8 adapters' journals synced one after another cost 43-57 ms a step on the GPU
    machines' disks, about 1 ms at once. Each fsync here waits until 4 are in flight: one
    after another, the first would wait for ever (the barrier breaks after 10 s)."""
    real = os.fsync
    meet = threading.Barrier(4, timeout=10)
    done = []

    def together(fd):
        meet.wait()
        real(fd)
        done.append(fd)

    journal = Journal(tmp_path)
    _step(journal, [("a", 1), ("b", 1), ("c", 1), ("d", 1)])  # (new files and their folders)
    monkeypatch.setattr(os, "fsync", together)
    _step(journal, [("a", 2), ("b", 2), ("c", 2), ("d", 2)])
    assert len(done) == 4  # every one of them, before flush returned
    assert journal.disk.syncs == (4 + 4 + 1) + 4  # (4 files, their folders, live_dir; 4 files)


def test_a_rewrite_after_a_persisted_version_is_synced_before_it_replaces(tmp_path, fsyncs):
    journal = Journal(tmp_path)
    _step(journal, [("a", 1), ("a", 2), ("a", 3)])
    fsyncs.clear()
    journal.persisted("a", 2)
    asyncio.run(journal.flush())
    assert str(tmp_path / "a" / ".journal.tmp") in {p for p, _ in fsyncs}
    fresh = Journal(tmp_path)
    fresh.load("a")
    assert [e.mark for e in fresh.since("a", 0)] == [3]


def test_with_journal_fsync_off_records_are_written_at_once_and_never_synced(tmp_path, fsyncs):
    journal = Journal(tmp_path, fsync=False)
    journal.record("a", 1, b"op")
    fresh = Journal(tmp_path)
    fresh.load("a")
    assert [e.mark for e in fresh.since("a", 0)] == [1]
    asyncio.run(journal.flush())
    assert fsyncs == []


def test_journal_fsync_is_a_config_key_on_by_default(tmp_path):
    assert Config().journal_fsync is True
    cfg = tmp_path / "twinkled.toml"
    cfg.write_text("journal_fsync = false\n")
    assert check_config(cfg) == []
    assert Config.load(cfg).journal_fsync is False
    cfg.write_text('journal_fsync = "no"\n')
    assert any("journal_fsync" in p for p in check_config(cfg))


def test_ops_of_futures_a_crash_cut_short_are_not_replayed(tmp_path):
    """A crash between journaling a step and acknowledging it: the restarted daemon tells
    those clients to submit again, so replaying the ops too would apply them twice."""
    journal = Journal(tmp_path)
    journal.record("a", 1, b"acknowledged", "req-1")
    journal.record("a", 2, b"cut short", "req-2")
    asyncio.run(journal.flush())
    fresh = Journal(tmp_path)
    fresh.void({"req-2"})
    fresh.load("a")
    assert [e.frame for e in fresh.since("a", 0)] == [b"acknowledged"]


def test_a_journal_removed_with_its_model_folder_meanwhile_is_no_error(tmp_path, monkeypatch):
    """A model unloaded for good: the worker's persister removes its whole live folder while
    the daemon's journal removes the journal in it. Whichever comes first, the step goes on
    (before: FileNotFoundError failed the demo's last step, the client's acknowledged
    optim_step with it)."""
    import pathlib
    import shutil

    journal = Journal(tmp_path)
    _step(journal, [("a", 1), ("b", 1)])
    real = pathlib.Path.unlink

    def worker_first(self, missing_ok=False):  # the worker's rmtree lands just before
        if self.name == ".journal":
            shutil.rmtree(self.parent, ignore_errors=True)
        return real(self, missing_ok=missing_ok)

    monkeypatch.setattr(pathlib.Path, "unlink", worker_first)
    journal.forget("a")
    journal.record("b", 2, b"op 2")
    asyncio.run(journal.flush())
    assert not (tmp_path / "a").exists()
    fresh = Journal(tmp_path)
    fresh.load("b")
    assert [e.mark for e in fresh.since("b", 0)] == [1, 2]
