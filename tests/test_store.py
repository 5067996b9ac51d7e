"""Tests of twinkled.store: SQLite persistence (no torch, no network)."""

from __future__ import annotations

import json
import sqlite3
import sys
import threading
import time
from datetime import UTC

import pytest

from twinkled.protocol.checkpoints import checkpoint_path
from twinkled.protocol.errors import Conflict
from twinkled.store import Store
from twinkled.store.checkpoints import Version
from twinkled.store.schema import MIN_FUTURE_TTL_S, hash_key, now, to_datetime


@pytest.fixture()
def db_path(tmp_path):
    return tmp_path / "data" / "nested" / "twinkle.db"


@pytest.fixture()
def store(db_path):
    s = Store(db_path)
    yield s
    s.close()


def reopen(store: Store, db_path) -> Store:
    """Simulate a daemon restart: close the store and open a new one on the same file."""
    store.close()
    return Store(db_path)


def test_store_does_not_import_torch():
    import subprocess

    code = "import sys, twinkled.store; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_creates_parent_dirs_and_wal(store, db_path):
    assert db_path.exists()
    assert store.db.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    # WAL is a property of the file: a plain connection sees it too.
    conn = sqlite3.connect(db_path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()
    assert {"tenants", "api_keys", "sessions", "runs", "checkpoints", "samplers",
            "futures"} <= set(store.db.sqlite.table_names())


# -- tenants and keys ---------------------------------------------------------------------

def test_tenants(store):
    store.tenants.ensure("alice")
    store.tenants.ensure("alice")  # idempotent
    assert store.tenants.ensure("bob", weight=2.5)["weight"] == 2.5
    assert store.tenants.ensure("bob")["weight"] == 2.5  # not reset when weight omitted
    assert [t["name"] for t in store.tenants.list()] == ["alice", "bob"]
    assert store.tenants.get("alice")["weight"] == 1.0
    assert store.tenants.get("nobody") is None


def test_keys_hashed_and_revocable(store, db_path):
    key = store.tenants.create_key("alice")
    key2 = store.tenants.create_key("alice")
    other = store.tenants.create_key("bob")
    assert key.startswith("tml-") and len(key) > 40 and key != key2
    assert store.tenants.for_key(key) == "alice"
    assert store.tenants.for_key(other) == "bob"
    assert store.tenants.for_key("tml-unknown") is None
    assert store.tenants.get("alice") is not None  # create_key registers the tenant

    # Only the hash is stored: the raw key never reaches the database files.
    store.db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    raw = b"".join(p.read_bytes() for p in db_path.parent.iterdir() if p.is_file())
    for k in (key, key2, other):
        assert k.encode() not in raw
        assert k[4:].encode() not in raw
    assert hash_key(key).encode() in raw

    listed = store.tenants.list_keys("alice")
    assert len(listed) == 2 and {r["tenant"] for r in listed} == {"alice"}
    assert all(set(r) == {"key_prefix", "tenant", "created", "revoked_at"} for r in listed)
    assert hash_key(key)[:12] in {r["key_prefix"] for r in listed}
    assert len(store.tenants.list_keys()) == 3

    assert store.tenants.revoke_key(key) is True
    assert store.tenants.for_key(key) is None
    assert store.tenants.for_key(key2) == "alice"  # other keys unaffected
    assert store.tenants.revoke_key(key) is False  # already revoked

    # revoke by the hash prefix an admin sees in list_keys
    assert store.tenants.revoke_key(hash_key(other)[:12]) is True
    assert store.tenants.for_key(other) is None
    with pytest.raises(ValueError):
        store.tenants.revoke_key("ab")  # too short to be safe
    revoked = [r for r in store.tenants.list_keys() if r["revoked_at"] is not None]
    assert len(revoked) == 2


def test_known_keys_are_remembered_briefly(store, db_path, monkeypatch):
    """A key revoked by another process (ctl on the data directory) is refused once the
    cache entry expires; one revoked through this store at once."""
    import twinkled.store.tenants as st

    key = store.tenants.create_key("alice")
    assert store.tenants.for_key(key) == "alice"
    other = Store(db_path)  # another process's view of the same file
    assert other.tenants.revoke_key(key) is True
    assert store.tenants.for_key(key) == "alice"  # within KEY_CACHE_S
    monkeypatch.setattr(st, "KEY_CACHE_S", 0.0)
    assert store.tenants.for_key(key) is None
    monkeypatch.undo()
    key2 = store.tenants.create_key("alice")
    assert store.tenants.for_key(key2) == "alice"
    assert store.tenants.revoke_key(key2) is True
    assert store.tenants.for_key(key2) is None  # revoked here: refused at once
    other.close()


def test_touch_writes_at_most_once_a_second(store, monkeypatch):
    import twinkled.store.runs as sr

    sid = store.sessions.create("alice", None, None)
    run = store.runs.create(sid, "alice", "m", 8)
    times = iter([1000.0, 1000.5, 1001.2])
    monkeypatch.setattr(sr, "now", lambda: next(times))
    seen = []
    for _ in range(3):
        assert store.runs.touch(run)
        seen.append(store.runs.get(run)["last_request_time"])
    assert seen == [1000.0, 1000.0, 1001.2]


# -- sessions -----------------------------------------------------------------------------

def test_sessions_and_counters(store):
    sid = store.sessions.create("alice", {"project": "x"}, "0.38.0")
    assert sid.startswith("sess-") and len(sid) == 5 + 32
    row = store.sessions.get(sid)
    assert row["tenant"] == "alice" and row["user_metadata"] == {"project": "x"}
    assert row["sdk_version"] == "0.38.0" and row["finished_at"] is None
    assert store.sessions.get("sess-missing") is None

    assert [store.sessions.next_model_seq(sid) for _ in range(3)] == [0, 1, 2]
    assert [store.sessions.next_sampler_seq(sid) for _ in range(2)] == [0, 1]  # separate counter
    sid2 = store.sessions.create("alice", None, None)
    assert store.sessions.next_model_seq(sid2) == 0  # per session
    with pytest.raises(KeyError):
        store.sessions.next_model_seq("sess-missing")

    before = store.sessions.get(sid)["last_heartbeat"]
    assert store.sessions.heartbeat(sid) and store.sessions.get(sid)["last_heartbeat"] >= before
    assert store.sessions.heartbeat("sess-missing") is False
    assert store.sessions.finish(sid) is True
    assert store.sessions.get(sid)["finished_at"] is not None

    store.sessions.create("bob", None, None)
    rows, total = store.sessions.list("alice", offset=0, limit=1)
    assert total == 2 and [r["id"] for r in rows] == [sid2]  # newest first
    rows, _ = store.sessions.list("alice", offset=1, limit=10)
    assert [r["id"] for r in rows] == [sid]


def test_counters_are_atomic_across_threads(store):
    sid = store.sessions.create("alice", None, None)
    got: list[int] = []
    lock = threading.Lock()

    def grab():
        for _ in range(50):
            n = store.sessions.next_model_seq(sid)
            with lock:
                got.append(n)

    threads = [threading.Thread(target=grab) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(400))


# -- runs ---------------------------------------------------------------------------------

def test_runs(store):
    sid = store.sessions.create("alice", None, None)
    ids = [store.runs.create(sid, "alice", "Qwen/Qwen3-8B", 8, {"rank": 8}, {"i": str(i)})
           for i in range(5)]
    assert ids == [f"{sid}:train:{i}" for i in range(5)]
    run = store.runs.get(ids[0])
    assert run["tenant"] == "alice" and run["lora_rank"] == 8
    assert run["lora_config"] == {"rank": 8} and run["user_metadata"] == {"i": "0"}
    assert run["corrupted"] is False and run["deleted"] is False
    assert store.runs.get("nope") is None

    other = store.sessions.create("bob", None, None)
    store.runs.create(other, "bob", "Qwen/Qwen3-8B", 4)

    rows, total = store.runs.list("alice", offset=0, limit=2)
    assert total == 5 and [r["id"] for r in rows] == [ids[4], ids[3]]
    rows, total = store.runs.list("alice", offset=4, limit=2)
    assert total == 5 and [r["id"] for r in rows] == [ids[0]]
    assert store.runs.list("alice", offset=10, limit=2) == ([], 5)

    t0 = store.runs.get(ids[0])["last_request_time"]
    assert store.runs.touch(ids[0]) and store.runs.get(ids[0])["last_request_time"] >= t0
    assert store.runs.set_corrupted(ids[1]) and store.runs.get(ids[1])["corrupted"] is True

    assert store.runs.delete(ids[2]) is True
    assert store.runs.delete(ids[2]) is False
    assert store.runs.get(ids[2]) is None
    assert store.runs.get(ids[2], include_deleted=True)["deleted"] is True
    assert store.runs.list("alice")[1] == 4
    assert store.sessions.children(sid) == ([ids[0], ids[1], ids[3], ids[4]], [])


def test_run_with_client_chosen_seq(store):
    """The Tinker client sends model_seq_id itself; the counter must move past it."""
    sid = store.sessions.create("alice", None, None)
    assert store.runs.create(sid, "alice", "m", 8, model_seq=0) == f"{sid}:train:0"
    with pytest.raises(Conflict):
        store.runs.create(sid, "alice", "m", 8, model_seq=0)
    assert store.runs.create(sid, "alice", "m", 8, model_seq=3) == f"{sid}:train:3"
    assert store.runs.create(sid, "alice", "m", 8) == f"{sid}:train:4"
    with pytest.raises(KeyError):
        store.runs.create("sess-missing", "alice", "m", 8)


# -- checkpoints --------------------------------------------------------------------------

def test_checkpoint_paths():
    assert checkpoint_path("s:train:0", "weights", "step-1") == "tinker://s:train:0/weights/step-1"
    for bad in [("r", "weights", "a/b"), ("r", "weights", ".."), ("r", "weights", ""),
                ("r", "bogus", "x"), ("a/b", "weights", "x")]:
        with pytest.raises(ValueError):
            checkpoint_path(*bad)


def test_checkpoint_lifecycle(store, tmp_path):
    sid = store.sessions.create("alice", None, None)
    run = store.runs.create(sid, "alice", "m", 8)
    p1 = store.checkpoints.begin(run, "alice", "weights", "step-1", str(tmp_path / "c1"))
    assert p1 == f"tinker://{run}/weights/step-1"
    row = store.checkpoints.get(p1)
    assert row["status"] == "writing" and row["checkpoint_type"] == "training"
    assert row["public"] is False and row["size_bytes"] is None
    # still writing: not listed
    assert store.checkpoints.list(run_id=run) == ([], 0)

    assert store.checkpoints.finish(p1, 1234, "ab" * 32) is True
    row = store.checkpoints.get(p1)
    assert (row["status"], row["size_bytes"], row["sha256"]) == ("ready", 1234, "ab" * 32)

    p2 = store.checkpoints.begin(run, "alice", "sampler_weights", "final", str(tmp_path / "c2"),
                                 user_metadata={"note": "x"})
    store.checkpoints.finish(p2, 10, "cd" * 32)
    assert store.checkpoints.get(p2)["checkpoint_type"] == "sampler"
    assert store.checkpoints.get(p2)["user_metadata"] == {"note": "x"}
    p3 = store.checkpoints.begin(run, "alice", "weights", "bad", str(tmp_path / "c3"))
    assert store.checkpoints.mark_corrupt(p3, "sha256 mismatch") is True
    assert store.checkpoints.get(p3)["status"] == "corrupt"
    assert store.checkpoints.get(p3)["error"] == "sha256 mismatch"

    rows, total = store.checkpoints.list(run_id=run)
    assert total == 2 and [r["tinker_path"] for r in rows] == [p2, p1]  # newest first
    rows, total = store.checkpoints.list(tenant="alice", offset=1, limit=1)
    assert total == 2 and [r["tinker_path"] for r in rows] == [p1]
    assert store.checkpoints.list(tenant="bob") == ([], 0)
    assert store.checkpoints.latest(run, "weights")["tinker_path"] == p1
    assert store.checkpoints.latest(run, "sampler_weights")["tinker_path"] == p2

    assert store.checkpoints.set_public(p1, True) and store.checkpoints.get(p1)["public"] is True
    assert store.checkpoints.set_public(p1, False) and store.checkpoints.get(p1)["public"] is False
    assert store.checkpoints.set_public("tinker://x/weights/none", True) is False

    t = now()
    assert store.checkpoints.set_expiry(p1, t - 1) and store.checkpoints.set_expiry(p2, t + 3600)
    assert [r["tinker_path"] for r in store.checkpoints.expired(t)] == [p1]
    assert {r["tinker_path"] for r in store.checkpoints.expired(t + 7200)} == {p1, p2}
    assert store.checkpoints.set_expiry(p1, None) and store.checkpoints.expired(t) == []

    deleted = store.checkpoints.delete(p1)
    assert deleted["dir"] == str(tmp_path / "c1")
    assert store.checkpoints.get(p1) is None and store.checkpoints.delete(p1) is None
    assert store.checkpoints.list(run_id=run)[1] == 1


def test_resave_same_name_and_abandoned_writes(store, db_path):
    sid = store.sessions.create("alice", None, None)
    run = store.runs.create(sid, "alice", "m", 8)
    p = store.checkpoints.begin(run, "alice", "weights", "w", "/d/1")
    store.checkpoints.finish(p, 1, "00")
    store.checkpoints.set_public(p, True)
    with pytest.raises(Conflict):  # ready: replaced only when asked to
        store.checkpoints.begin(run, "alice", "weights", "w", "/d/2")
    # A new version replaces a ready one only once written: until then the old one is
    # served as it was, and a failed save leaves it so.
    assert store.checkpoints.begin(run, "alice", "weights", "w", "/d/2", overwrite=True) == p
    old = store.checkpoints.get(p)
    assert (old["status"], old["dir"], old["public"]) == ("ready", "/d/1", True)
    assert store.checkpoints.abandon(p, "the save failed") is False
    assert store.checkpoints.get(p)["status"] == "ready"
    version = Version(run, "alice", "weights", "w", "/d/2", {"v": 2})
    assert store.checkpoints.finish(p, 2, "11", version=version)
    new = store.checkpoints.get(p)
    assert (new["status"], new["dir"], new["sha256"], new["public"], new["user_metadata"]) == (
        "ready", "/d/2", "11", False, {"v": 2})
    store.checkpoints.begin(run, "alice", "weights", "w", "/d/3", overwrite=True)
    q = store.checkpoints.begin(run, "alice", "weights", "other", "/d/3")

    store = reopen(store, db_path)  # crash while writing
    abandoned = store.checkpoints.abandon_writing("daemon restarted during write")
    assert {r["tinker_path"] for r in abandoned} == {q}  # the pending new version of p: none
    assert store.checkpoints.get(q)["status"] == "corrupt"
    assert store.checkpoints.get(p)["status"] == "ready"
    assert store.checkpoints.abandon_writing("again") == []
    store.close()


# -- samplers -----------------------------------------------------------------------------

def test_samplers(store):
    sid = store.sessions.create("alice", None, None)
    s0 = store.samplers.create(sid, "alice", "m")
    s1 = store.samplers.create(sid, "alice", "m", model_path="tinker://r/sampler_weights/x")
    assert (s0, s1) == (f"{sid}:sample:0", f"{sid}:sample:1")
    assert store.samplers.get(s1)["model_path"] == "tinker://r/sampler_weights/x"
    assert store.samplers.get(s0)["model_path"] is None
    assert store.samplers.get("nope") is None
    assert store.samplers.create(sid, "alice", "m", sampler_seq=7) == f"{sid}:sample:7"
    with pytest.raises(Conflict):
        store.samplers.create(sid, "alice", "m", sampler_seq=7)
    assert store.sessions.children(sid) == ([], [s0, s1, f"{sid}:sample:7"])


# -- futures ------------------------------------------------------------------------------

def test_futures_roundtrip(store):
    fid = store.futures.create("req-1", "alice", "forward_backward", "r:train:0", 1)
    assert fid == "req-1"
    row = store.futures.get(fid)
    assert row["status"] == "pending" and row["result"] is None and row["tenant"] == "alice"
    payload = b"\x00\x01proto\xff"
    assert store.futures.complete(fid, payload, "application/x-protobuf") is True
    row = store.futures.get(fid)
    assert row["status"] == "done" and row["result"] == payload
    assert row["content_type"] == "application/x-protobuf" and row["completed_at"] is not None
    # first resolution wins
    assert store.futures.fail(fid, "late", "server") is False
    assert store.futures.get(fid)["result"] == payload

    store.futures.create("req-2", "alice", "optim_step", "r:train:0", 2)
    assert store.futures.fail("req-2", "NaN advantages", "user") is True
    row = store.futures.get("req-2")
    assert row["status"] == "error" and row["content_type"] == "application/json"
    assert json.loads(row["result"]) == {"error": "NaN advantages", "category": "user"}
    assert store.futures.get("nope") is None
    assert store.futures.complete("nope", b"{}", "application/json") is False


def test_futures_idempotent_by_model_and_seq(store):
    store.futures.create("req-1", "alice", "forward_backward", "r:train:0", 1)
    assert store.futures.find("r:train:0", 1) == "req-1"
    assert store.futures.find("r:train:0", 2) is None
    assert store.futures.find("r:train:1", 1) is None
    # a retried POST returns the original id and creates nothing
    assert store.futures.create("req-9", "alice", "forward_backward", "r:train:0", 1) == "req-1"
    assert store.futures.get("req-9") is None
    # futures without a seq_id (create_model, REST) never collide
    assert store.futures.create("a", "alice", "create_model") == "a"
    assert store.futures.create("b", "alice", "create_model") == "b"


def test_pending_futures_fail_after_restart(store, db_path):
    store.futures.create("p1", "alice", "forward_backward", "r:train:0", 1)
    store.futures.create("p2", "alice", "sample", "s:sample:0", 1)
    store.futures.create("d1", "alice", "optim_step", "r:train:0", 2)
    store.futures.complete("d1", b'{"metrics": {}}', "application/json")

    store = reopen(store, db_path)
    assert store.futures.get("p1")["status"] == "pending"  # survived the restart
    assert store.futures.fail_pending("daemon restarted") == 2
    for fid in ("p1", "p2"):
        row = store.futures.get(fid)
        assert row["status"] == "error"
        assert json.loads(row["result"]) == {"error": "daemon restarted", "category": "server"}
    assert store.futures.get("d1")["result"] == b'{"metrics": {}}'  # untouched
    assert store.futures.fail_pending("again") == 0
    store.close()


def test_failed_training_names_runs_whose_last_training_op_failed(store):
    f = store.futures
    history = [  # (future, kind, run, seq_id, error and category; None: done)
        # r1: its forward_backward failed, nothing after it but a forward: lost gradients
        ("a1", "forward_backward", "r1", 4, ("worker lost", "server")),
        ("a2", "forward", "r1", 5, None),
        # r2: failed, then the optim_step behind it failed too: accounted for
        ("b1", "forward_backward", "r2", 1, ("x", "server")),
        ("b2", "optim_step", "r2", 2, ("x", "server")),
        # r3: failed, then redone: trained
        ("c1", "forward_backward", "r3", 1, ("x", "user")),
        ("c2", "forward_backward", "r3", 2, None),
        # r4: a forward that failed loses no gradients; r5: refused at the door (no seq_id)
        ("d1", "forward", "r4", 1, ("x", "server")),
        ("e1", "forward_backward", "r5", None, ("bad datum", "user")),
    ]
    for fid, kind, run, seq, error in history:
        f.create(fid, "alice", kind, run, seq)
        if error is None:
            f.complete(fid, b"{}", "application/json")
        else:
            f.fail(fid, *error)
    assert f.failed_training() == [("r1", 4, "worker lost", "server")]


def test_purge_futures_keeps_recent_and_pending(store):
    store.futures.create("old", "alice", "optim_step", "r", 1)
    store.futures.create("new", "alice", "optim_step", "r", 2)
    store.futures.create("pending", "alice", "optim_step", "r", 3)
    store.futures.complete("old", b"{}", "application/json")
    store.futures.fail("new", "x", "user")
    t = now()
    store.db.write("UPDATE futures SET completed_at = ? WHERE id = 'old'", [t - 3600])
    store.db.write("UPDATE futures SET created = ? WHERE id = 'pending'", [t - 86400])

    # an age below the floor is raised to MIN_FUTURE_TTL_S: nothing recent goes
    assert store.futures.purge(0, at=t) == 1
    assert store.futures.get("old") is None
    assert store.futures.get("new") is not None and store.futures.get("pending") is not None
    assert store.futures.find("r", 1) is None  # the (model_id, seq_id) slot is free again
    assert store.futures.purge(600, at=t + MIN_FUTURE_TTL_S - 1) == 0
    assert store.futures.purge(600, at=t + 601) == 1
    assert store.futures.get("pending") is not None  # pending futures are never purged


# -- restart ------------------------------------------------------------------------------

def test_everything_survives_reopen(store, db_path):
    key = store.tenants.create_key("alice")
    sid = store.sessions.create("alice", {"a": "b"}, "0.38.0")
    run = store.runs.create(sid, "alice", "m", 8, {"rank": 8})
    p = store.checkpoints.begin(run, "alice", "weights", "w", "/d")
    store.checkpoints.finish(p, 5, "ff")
    sampler = store.samplers.create(sid, "alice", "m", p)
    store.futures.create("f", "alice", "save_weights", run, 1)
    store.futures.complete("f", b'{"path": "x"}', "application/json")

    store = reopen(store, db_path)
    assert store.tenants.for_key(key) == "alice"
    assert store.sessions.get(sid)["user_metadata"] == {"a": "b"}
    assert store.runs.get(run)["lora_config"] == {"rank": 8}
    assert store.checkpoints.get(p)["status"] == "ready"
    assert store.samplers.get(sampler)["model_path"] == p
    assert store.futures.get("f")["result"] == b'{"path": "x"}'
    assert store.futures.find(run, 1) == "f"
    # counters continue where they left off
    assert store.sessions.next_model_seq(sid) == 1 and store.sessions.next_sampler_seq(sid) == 1
    assert store.db.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store.close()


def test_to_datetime():
    assert to_datetime(None) is None
    dt = to_datetime(0.0)
    assert dt.tzinfo == UTC and dt.year == 1970


def test_housekeeping_deletes_expired_checkpoints_and_their_files(store, tmp_path):
    """A checkpoint past its ttl is deleted, record and files, at the minute tick; one
    not yet expired, or without a ttl, stays."""
    from twinkled.core.futures import Futures
    from twinkled.core.housekeeping import Housekeeping
    from twinkled.protocol.blobs import Blobs
    from twinkled.protocol.config import Config

    sid = store.sessions.create("alice", None, None)
    run = store.runs.create(sid, "alice", "m", 8)
    paths = {}
    for name, expires in (("old", now() - 1), ("later", now() + 3600), ("kept", None)):
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_model.safetensors").write_bytes(b"x")
        paths[name] = store.checkpoints.begin(run, "alice", "weights", name, str(d),
                                              expires_at=expires)
        store.checkpoints.finish(paths[name], 1, "ab" * 32)
    config = Config(model=tmp_path, data_dir=tmp_path)
    house = Housekeeping(config, store, Futures(store), adapters=None,
                         blobs=Blobs.from_config(config), status=dict, refresh_tenants=lambda: None,
                         may_unload=lambda: False)
    house.tick(minute=False)  # the few-seconds tick does not collect
    assert store.checkpoints.get(paths["old"]) is not None
    house.tick(minute=True)
    assert store.checkpoints.get(paths["old"]) is None
    deadline = time.monotonic() + 30  # the files go in a thread (Blobs.delete_later)
    while (tmp_path / "old").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (tmp_path / "old").exists()
    for name in ("later", "kept"):
        assert store.checkpoints.get(paths[name])["status"] == "ready"
        assert (tmp_path / name / "adapter_model.safetensors").is_file()
