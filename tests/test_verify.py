"""Tests of twinkled.store.verify: checkpoint integrity checks and `twinkled ctl checkpoints`."""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from twinkled.protocol import checkpoints
from twinkled.protocol.checkpoints import checkpoint_digest
from twinkled.server.cli import main
from twinkled.store import Store
from twinkled.store.verify import verify_checkpoints

FILES = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": bytes(range(256)) * 40,
         "optimizer.safetensors": b"\x01\x02" * 3000}


def expected_digest(files: dict[str, bytes]) -> tuple[int, str]:
    """The digest format, written out independently: name, NUL, bytes; files by name."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + files[name])
    return sum(len(b) for b in files.values()), h.hexdigest()


@pytest.fixture()
def data_dir(tmp_path):
    return tmp_path / "data"


@pytest.fixture()
def store(data_dir):
    s = Store(data_dir / "twinkle.db")
    yield s
    s.close()


def save(store: Store, data_dir: Path, name: str, tenant: str = "alice",
         run: str | None = None) -> tuple[str, Path]:
    """A checkpoint written and registered the way the daemon does it."""
    if run is None:
        run = store.runs.create(store.sessions.create(tenant, None, None), tenant, "m", 8)
    directory = data_dir / "checkpoints" / run / "weights" / name
    directory.mkdir(parents=True)
    for fname, data in FILES.items():
        (directory / fname).write_bytes(data)
    path = store.checkpoints.begin(run, tenant, "weights", name, str(directory))
    assert store.checkpoints.finish(path, *checkpoint_digest(directory))
    return path, directory


def quarantined(data_dir: Path) -> list[Path]:
    q = data_dir / "quarantine"
    return sorted(q.iterdir()) if q.exists() else []


def test_verify_does_not_import_torch():
    code = "import sys, twinkled.store.verify; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_digest_format_and_chunking(tmp_path, monkeypatch):
    for name, data in FILES.items():
        (tmp_path / name).write_bytes(data)
    assert checkpoint_digest(tmp_path) == expected_digest(FILES)
    monkeypatch.setattr(checkpoints, "CHUNK_BYTES", 7)  # many chunks per file: same digest
    assert checkpoint_digest(tmp_path) == expected_digest(FILES)


def test_intact_checkpoint_stays_ready(store, data_dir):
    path, directory = save(store, data_dir, "good")
    assert verify_checkpoints(store, data_dir) == []
    row = store.checkpoints.get(path)
    assert row["status"] == "ready" and row["error"] is None
    assert {f.name: f.read_bytes() for f in directory.iterdir()} == FILES
    assert quarantined(data_dir) == []


def test_flipped_byte_is_quarantined(store, data_dir, caplog):
    good, _ = save(store, data_dir, "good")
    path, directory = save(store, data_dir, "flipped")
    f = directory / "adapter_model.safetensors"
    data = bytearray(f.read_bytes())
    data[1000] ^= 0xFF  # same size, different bytes
    f.write_bytes(bytes(data))

    with caplog.at_level(logging.WARNING, logger="twinkled"):
        found = verify_checkpoints(store, data_dir)
    assert [d["tinker_path"] for d in found] == [path]
    moved = Path(found[0]["moved_to"])
    assert quarantined(data_dir) == [moved] and moved.name.endswith("-flipped")
    assert not directory.exists()
    # never deleted: the damaged bytes are all there, in quarantine
    assert (moved / "adapter_model.safetensors").read_bytes() == bytes(data)
    row = store.checkpoints.get(path)
    assert row["status"] == "corrupt"
    assert row["error"] == found[0]["reason"]
    assert "sha256 mismatch" in row["error"] and str(moved) in row["error"]
    assert checkpoint_digest(moved)[1][:12] in row["error"]  # names what it found
    assert any(path in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records if r.name == "twinkled")
    # hidden from listings; the intact one is untouched
    assert [r["tinker_path"] for r in store.checkpoints.list()[0]] == [good]
    assert store.checkpoints.get(good)["status"] == "ready"
    # a second pass finds nothing new
    assert verify_checkpoints(store, data_dir) == []


def test_missing_directory(store, data_dir):
    path, directory = save(store, data_dir, "gone")
    for f in directory.iterdir():
        f.unlink()
    directory.rmdir()
    found = verify_checkpoints(store, data_dir)
    assert found == [{"tinker_path": path, "reason": f"missing directory {directory}",
                      "moved_to": None}]
    row = store.checkpoints.get(path)
    assert row["status"] == "corrupt" and row["error"].startswith("missing directory")
    assert quarantined(data_dir) == []


def test_truncated_file(store, data_dir):
    path, directory = save(store, data_dir, "short")
    f = directory / "optimizer.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    found = verify_checkpoints(store, data_dir)
    assert [d["tinker_path"] for d in found] == [path]
    row = store.checkpoints.get(path)
    assert row["status"] == "corrupt"
    assert "size mismatch" in row["error"] and str(sum(map(len, FILES.values()))) in row["error"]
    assert quarantined(data_dir) == [Path(found[0]["moved_to"])]
    assert not directory.exists()


def test_unreadable_directory_and_name_clash(store, data_dir):
    """A file where the directory should be cannot be read; two damaged checkpoints with
    the same name (different runs) both get their own place in quarantine."""
    path1, dir1 = save(store, data_dir, "final")
    path2, dir2 = save(store, data_dir, "final")
    for f in dir1.iterdir():
        f.unlink()
    dir1.rmdir()
    dir1.write_bytes(b"not a directory")
    (dir2 / "extra.bin").write_bytes(b"x")  # a file that was not there: size differs
    found = {d["tinker_path"]: d for d in verify_checkpoints(store, data_dir)}
    assert set(found) == {path1, path2}
    assert found[path1]["reason"].startswith("unreadable")
    moved = {Path(d["moved_to"]) for d in found.values()}
    assert set(quarantined(data_dir)) == moved and len(moved) == 2
    assert all(store.checkpoints.get(p)["status"] == "corrupt" for p in found)


def test_only_ready_checkpoints_are_checked(store, data_dir):
    path, directory = save(store, data_dir, "old")
    store.checkpoints.mark_corrupt(path, "earlier reason")
    writing = store.checkpoints.begin(store.checkpoints.get(path)["run_id"], "alice", "weights",
                                      "inflight", str(data_dir / "nowhere"))
    assert verify_checkpoints(store, data_dir) == []
    assert store.checkpoints.get(path)["error"] == "earlier reason"
    assert store.checkpoints.get(writing)["status"] == "writing"
    assert directory.exists()


def test_list_checkpoints_status_filter(store, data_dir):
    ready, _ = save(store, data_dir, "a")
    bad, _ = save(store, data_dir, "b")
    store.checkpoints.mark_corrupt(bad, "why")
    assert [r["tinker_path"] for r in store.checkpoints.list()[0]] == [ready]  # default
    assert [r["tinker_path"] for r in store.checkpoints.list(status="corrupt")[0]] == [bad]
    rows, total = store.checkpoints.list(status=None)
    assert total == 2 and {r["tinker_path"] for r in rows} == {ready, bad}


# -- twinkled ctl checkpoints -------------------------------------------------------------

def ctl(data_dir: Path, *args: str):
    result = CliRunner().invoke(main, ["ctl", "--data-dir", str(data_dir), *args])
    assert result.exit_code == 0, result.output
    return result


def test_ctl_list_and_verify(store, data_dir):
    good, _ = save(store, data_dir, "good", tenant="alice")
    bad, bad_dir = save(store, data_dir, "bad", tenant="alice")
    bob, _ = save(store, data_dir, "theirs", tenant="bob")
    (bad_dir / "adapter_config.json").write_bytes(b'{"r": 9}')

    listed = json.loads(ctl(data_dir, "checkpoints", "list", "--json").stdout)
    assert {r["tinker_path"]: r["status"] for r in listed} == {good: "ready", bad: "ready",
                                                               bob: "ready"}
    assert json.loads(ctl(data_dir, "checkpoints", "list", "--status", "corrupt",
                          "--json").stdout) == []
    listed = json.loads(ctl(data_dir, "checkpoints", "list", "--tenant", "bob", "--json").stdout)
    assert [r["tinker_path"] for r in listed] == [bob]
    run = store.checkpoints.get(good)["run_id"]
    listed = json.loads(ctl(data_dir, "checkpoints", "list", "--run", run, "--json").stdout)
    assert [r["tinker_path"] for r in listed] == [good]

    found = json.loads(ctl(data_dir, "checkpoints", "verify", "--json").stdout)
    assert [d["tinker_path"] for d in found] == [bad]
    assert "sha256 mismatch" in found[0]["reason"]
    assert Path(found[0]["moved_to"]).parent == data_dir / "quarantine"

    corrupt = json.loads(ctl(data_dir, "checkpoints", "list", "--status", "corrupt",
                             "--json").stdout)
    assert [(r["tinker_path"], r["error"]) for r in corrupt] == [(bad, found[0]["reason"])]
    ready = json.loads(ctl(data_dir, "checkpoints", "list", "--status", "ready",
                           "--json").stdout)
    assert {r["tinker_path"] for r in ready} == {good, bob}

    table = ctl(data_dir, "checkpoints", "list").stdout.splitlines()
    assert table[0].split()[:2] == ["checkpoint", "status"]  # the header, then one per row
    table = table[1:]
    assert len(table) == 3
    bad_line = next(line for line in table if line.startswith(bad + " "))
    assert "corrupt" in bad_line and "sha256 mismatch" in bad_line
    good_line = next(line for line in table if line.startswith(good + " "))
    assert "ready" in good_line and "KiB" in good_line and "mismatch" not in good_line

    out = ctl(data_dir, "checkpoints", "verify").stdout
    assert "all ready checkpoints are intact" in out


def test_ctl_verify_text_output(store, data_dir):
    path, directory = save(store, data_dir, "gone")
    for f in directory.iterdir():
        f.unlink()
    directory.rmdir()
    out = ctl(data_dir, "checkpoints", "verify").stdout
    assert f"{path}: missing directory {directory}" in out
    assert "1 damaged checkpoint(s) found" in out
