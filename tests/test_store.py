"""Tests of twinkled.store: SQLite persistence (no torch, no network)."""

from __future__ import annotations

import json
import sqlite3
import sys
import threading
from datetime import UTC

import pytest

from twinkled.store import (
    MIN_FUTURE_TTL_S,
    Conflict,
    Store,
    checkpoint_path,
    hash_key,
    now,
    to_datetime,
)


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
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    # WAL is a property of the file: a plain connection sees it too.
    conn = sqlite3.connect(db_path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()
    assert {"tenants", "api_keys", "sessions", "runs", "checkpoints", "samplers",
            "futures"} <= set(store.db.table_names())


# -- tenants and keys ---------------------------------------------------------------------

def test_tenants(store):
    store.ensure_tenant("alice")
    store.ensure_tenant("alice")  # idempotent
    assert store.ensure_tenant("bob", weight=2.5)["weight"] == 2.5
    assert store.ensure_tenant("bob")["weight"] == 2.5  # not reset when weight omitted
    assert [t["name"] for t in store.list_tenants()] == ["alice", "bob"]
    assert store.get_tenant("alice")["weight"] == 1.0
    assert store.get_tenant("nobody") is None


def test_keys_hashed_and_revocable(store, db_path):
    key = store.create_key("alice")
    key2 = store.create_key("alice")
    other = store.create_key("bob")
    assert key.startswith("tml-") and len(key) > 40 and key != key2
    assert store.tenant_for_key(key) == "alice"
    assert store.tenant_for_key(other) == "bob"
    assert store.tenant_for_key("tml-unknown") is None
    assert store.get_tenant("alice") is not None  # create_key registers the tenant

    # Only the hash is stored: the raw key never reaches the database files.
    store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    raw = b"".join(p.read_bytes() for p in db_path.parent.iterdir() if p.is_file())
    for k in (key, key2, other):
        assert k.encode() not in raw
        assert k[4:].encode() not in raw
    assert hash_key(key).encode() in raw

    listed = store.list_keys("alice")
    assert len(listed) == 2 and {r["tenant"] for r in listed} == {"alice"}
    assert all(set(r) == {"key_prefix", "tenant", "created", "revoked_at"} for r in listed)
    assert hash_key(key)[:12] in {r["key_prefix"] for r in listed}
    assert len(store.list_keys()) == 3

    assert store.revoke_key(key) is True
    assert store.tenant_for_key(key) is None
    assert store.tenant_for_key(key2) == "alice"  # other keys unaffected
    assert store.revoke_key(key) is False  # already revoked

    # revoke by the hash prefix an admin sees in list_keys
    assert store.revoke_key(hash_key(other)[:12]) is True
    assert store.tenant_for_key(other) is None
    with pytest.raises(ValueError):
        store.revoke_key("ab")  # too short to be safe
    revoked = [r for r in store.list_keys() if r["revoked_at"] is not None]
    assert len(revoked) == 2


# -- sessions -----------------------------------------------------------------------------

def test_sessions_and_counters(store):
    sid = store.create_session("alice", {"project": "x"}, "0.38.0")
    assert sid.startswith("sess-") and len(sid) == 5 + 32
    row = store.get_session(sid)
    assert row["tenant"] == "alice" and row["user_metadata"] == {"project": "x"}
    assert row["sdk_version"] == "0.38.0" and row["finished_at"] is None
    assert store.get_session("sess-missing") is None

    assert [store.next_model_seq(sid) for _ in range(3)] == [0, 1, 2]
    assert [store.next_sampler_seq(sid) for _ in range(2)] == [0, 1]  # separate counter
    sid2 = store.create_session("alice", None, None)
    assert store.next_model_seq(sid2) == 0  # per session
    with pytest.raises(KeyError):
        store.next_model_seq("sess-missing")

    before = store.get_session(sid)["last_heartbeat"]
    assert store.heartbeat(sid) and store.get_session(sid)["last_heartbeat"] >= before
    assert store.heartbeat("sess-missing") is False
    assert store.finish_session(sid) is True
    assert store.get_session(sid)["finished_at"] is not None

    store.create_session("bob", None, None)
    rows, total = store.list_sessions("alice", offset=0, limit=1)
    assert total == 2 and [r["id"] for r in rows] == [sid2]  # newest first
    rows, _ = store.list_sessions("alice", offset=1, limit=10)
    assert [r["id"] for r in rows] == [sid]


def test_counters_are_atomic_across_threads(store):
    sid = store.create_session("alice", None, None)
    got: list[int] = []
    lock = threading.Lock()

    def grab():
        for _ in range(50):
            n = store.next_model_seq(sid)
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
    sid = store.create_session("alice", None, None)
    ids = [store.create_run(sid, "alice", "Qwen/Qwen3-8B", 8, {"rank": 8}, {"i": str(i)})
           for i in range(5)]
    assert ids == [f"{sid}:train:{i}" for i in range(5)]
    run = store.get_run(ids[0])
    assert run["tenant"] == "alice" and run["lora_rank"] == 8
    assert run["lora_config"] == {"rank": 8} and run["user_metadata"] == {"i": "0"}
    assert run["corrupted"] is False and run["deleted"] is False
    assert store.get_run("nope") is None

    other = store.create_session("bob", None, None)
    store.create_run(other, "bob", "Qwen/Qwen3-8B", 4)

    rows, total = store.list_runs("alice", offset=0, limit=2)
    assert total == 5 and [r["id"] for r in rows] == [ids[4], ids[3]]
    rows, total = store.list_runs("alice", offset=4, limit=2)
    assert total == 5 and [r["id"] for r in rows] == [ids[0]]
    assert store.list_runs("alice", offset=10, limit=2) == ([], 5)

    t0 = store.get_run(ids[0])["last_request_time"]
    assert store.touch_run(ids[0]) and store.get_run(ids[0])["last_request_time"] >= t0
    assert store.set_run_corrupted(ids[1]) and store.get_run(ids[1])["corrupted"] is True

    assert store.delete_run(ids[2]) is True
    assert store.delete_run(ids[2]) is False
    assert store.get_run(ids[2]) is None
    assert store.get_run(ids[2], include_deleted=True)["deleted"] is True
    assert store.list_runs("alice")[1] == 4
    assert store.session_children(sid) == ([ids[0], ids[1], ids[3], ids[4]], [])


def test_run_with_client_chosen_seq(store):
    """The Tinker client sends model_seq_id itself; the counter must move past it."""
    sid = store.create_session("alice", None, None)
    assert store.create_run(sid, "alice", "m", 8, model_seq=0) == f"{sid}:train:0"
    with pytest.raises(Conflict):
        store.create_run(sid, "alice", "m", 8, model_seq=0)
    assert store.create_run(sid, "alice", "m", 8, model_seq=3) == f"{sid}:train:3"
    assert store.create_run(sid, "alice", "m", 8) == f"{sid}:train:4"
    with pytest.raises(KeyError):
        store.create_run("sess-missing", "alice", "m", 8)


# -- checkpoints --------------------------------------------------------------------------

def test_checkpoint_paths():
    assert checkpoint_path("s:train:0", "weights", "step-1") == "tinker://s:train:0/weights/step-1"
    for bad in [("r", "weights", "a/b"), ("r", "weights", ".."), ("r", "weights", ""),
                ("r", "bogus", "x"), ("a/b", "weights", "x")]:
        with pytest.raises(ValueError):
            checkpoint_path(*bad)


def test_checkpoint_lifecycle(store, tmp_path):
    sid = store.create_session("alice", None, None)
    run = store.create_run(sid, "alice", "m", 8)
    p1 = store.begin_checkpoint(run, "alice", "weights", "step-1", str(tmp_path / "c1"))
    assert p1 == f"tinker://{run}/weights/step-1"
    row = store.get_checkpoint(p1)
    assert row["status"] == "writing" and row["checkpoint_type"] == "training"
    assert row["public"] is False and row["size_bytes"] is None
    # still writing: not listed
    assert store.list_checkpoints(run_id=run) == ([], 0)

    assert store.finish_checkpoint(p1, 1234, "ab" * 32) is True
    row = store.get_checkpoint(p1)
    assert (row["status"], row["size_bytes"], row["sha256"]) == ("ready", 1234, "ab" * 32)

    p2 = store.begin_checkpoint(run, "alice", "sampler_weights", "final", str(tmp_path / "c2"),
                                user_metadata={"note": "x"})
    store.finish_checkpoint(p2, 10, "cd" * 32)
    assert store.get_checkpoint(p2)["checkpoint_type"] == "sampler"
    assert store.get_checkpoint(p2)["user_metadata"] == {"note": "x"}
    p3 = store.begin_checkpoint(run, "alice", "weights", "bad", str(tmp_path / "c3"))
    assert store.mark_corrupt(p3, "sha256 mismatch") is True
    assert store.get_checkpoint(p3)["status"] == "corrupt"
    assert store.get_checkpoint(p3)["error"] == "sha256 mismatch"

    rows, total = store.list_checkpoints(run_id=run)
    assert total == 2 and [r["tinker_path"] for r in rows] == [p2, p1]  # newest first
    rows, total = store.list_checkpoints(tenant="alice", offset=1, limit=1)
    assert total == 2 and [r["tinker_path"] for r in rows] == [p1]
    assert store.list_checkpoints(tenant="bob") == ([], 0)
    assert store.latest_checkpoint(run, "weights")["tinker_path"] == p1
    assert store.latest_checkpoint(run, "sampler_weights")["tinker_path"] == p2

    assert store.set_public(p1, True) and store.get_checkpoint(p1)["public"] is True
    assert store.set_public(p1, False) and store.get_checkpoint(p1)["public"] is False
    assert store.set_public("tinker://x/weights/none", True) is False

    t = now()
    assert store.set_expiry(p1, t - 1) and store.set_expiry(p2, t + 3600)
    assert [r["tinker_path"] for r in store.expired_checkpoints(t)] == [p1]
    assert {r["tinker_path"] for r in store.expired_checkpoints(t + 7200)} == {p1, p2}
    assert store.set_expiry(p1, None) and store.expired_checkpoints(t) == []

    deleted = store.delete_checkpoint(p1)
    assert deleted["dir"] == str(tmp_path / "c1")
    assert store.get_checkpoint(p1) is None and store.delete_checkpoint(p1) is None
    assert store.list_checkpoints(run_id=run)[1] == 1


def test_resave_same_name_and_abandoned_writes(store, db_path):
    sid = store.create_session("alice", None, None)
    run = store.create_run(sid, "alice", "m", 8)
    p = store.begin_checkpoint(run, "alice", "weights", "w", "/d/1")
    store.finish_checkpoint(p, 1, "00")
    store.set_public(p, True)
    with pytest.raises(Conflict):  # ready: replaced only when asked to
        store.begin_checkpoint(run, "alice", "weights", "w", "/d/2")
    assert store.begin_checkpoint(run, "alice", "weights", "w", "/d/2", overwrite=True) == p
    assert store.get_checkpoint(p)["status"] == "writing"
    assert store.get_checkpoint(p)["dir"] == "/d/2"
    assert store.get_checkpoint(p)["public"] is False
    q = store.begin_checkpoint(run, "alice", "weights", "other", "/d/3")

    store = reopen(store, db_path)  # crash while writing
    abandoned = store.abandon_writing_checkpoints("daemon restarted during write")
    assert {r["tinker_path"] for r in abandoned} == {p, q}
    assert store.get_checkpoint(q)["status"] == "corrupt"
    assert store.abandon_writing_checkpoints("again") == []
    store.close()


# -- samplers -----------------------------------------------------------------------------

def test_samplers(store):
    sid = store.create_session("alice", None, None)
    s0 = store.create_sampler(sid, "alice", "m")
    s1 = store.create_sampler(sid, "alice", "m", model_path="tinker://r/sampler_weights/x")
    assert (s0, s1) == (f"{sid}:sample:0", f"{sid}:sample:1")
    assert store.get_sampler(s1)["model_path"] == "tinker://r/sampler_weights/x"
    assert store.get_sampler(s0)["model_path"] is None
    assert store.get_sampler("nope") is None
    assert store.create_sampler(sid, "alice", "m", sampler_seq=7) == f"{sid}:sample:7"
    with pytest.raises(Conflict):
        store.create_sampler(sid, "alice", "m", sampler_seq=7)
    assert store.session_children(sid) == ([], [s0, s1, f"{sid}:sample:7"])


# -- futures ------------------------------------------------------------------------------

def test_futures_roundtrip(store):
    fid = store.create_future("req-1", "alice", "forward_backward", "r:train:0", 1)
    assert fid == "req-1"
    row = store.get_future(fid)
    assert row["status"] == "pending" and row["result"] is None and row["tenant"] == "alice"
    payload = b"\x00\x01proto\xff"
    assert store.complete_future(fid, payload, "application/x-protobuf") is True
    row = store.get_future(fid)
    assert row["status"] == "done" and row["result"] == payload
    assert row["content_type"] == "application/x-protobuf" and row["completed_at"] is not None
    # first resolution wins
    assert store.fail_future(fid, "late", "server") is False
    assert store.get_future(fid)["result"] == payload

    store.create_future("req-2", "alice", "optim_step", "r:train:0", 2)
    assert store.fail_future("req-2", "NaN advantages", "user") is True
    row = store.get_future("req-2")
    assert row["status"] == "error" and row["content_type"] == "application/json"
    assert json.loads(row["result"]) == {"error": "NaN advantages", "category": "user"}
    assert store.get_future("nope") is None
    assert store.complete_future("nope", b"{}", "application/json") is False


def test_futures_idempotent_by_model_and_seq(store):
    store.create_future("req-1", "alice", "forward_backward", "r:train:0", 1)
    assert store.find_future("r:train:0", 1) == "req-1"
    assert store.find_future("r:train:0", 2) is None
    assert store.find_future("r:train:1", 1) is None
    # a retried POST returns the original id and creates nothing
    assert store.create_future("req-9", "alice", "forward_backward", "r:train:0", 1) == "req-1"
    assert store.get_future("req-9") is None
    # futures without a seq_id (create_model, REST) never collide
    assert store.create_future("a", "alice", "create_model") == "a"
    assert store.create_future("b", "alice", "create_model") == "b"


def test_pending_futures_fail_after_restart(store, db_path):
    store.create_future("p1", "alice", "forward_backward", "r:train:0", 1)
    store.create_future("p2", "alice", "sample", "s:sample:0", 1)
    store.create_future("d1", "alice", "optim_step", "r:train:0", 2)
    store.complete_future("d1", b'{"metrics": {}}', "application/json")

    store = reopen(store, db_path)
    assert store.get_future("p1")["status"] == "pending"  # survived the restart
    assert store.fail_pending_futures("daemon restarted") == 2
    for fid in ("p1", "p2"):
        row = store.get_future(fid)
        assert row["status"] == "error"
        assert json.loads(row["result"]) == {"error": "daemon restarted", "category": "server"}
    assert store.get_future("d1")["result"] == b'{"metrics": {}}'  # untouched
    assert store.fail_pending_futures("again") == 0
    store.close()


def test_purge_futures_keeps_recent_and_pending(store):
    store.create_future("old", "alice", "optim_step", "r", 1)
    store.create_future("new", "alice", "optim_step", "r", 2)
    store.create_future("pending", "alice", "optim_step", "r", 3)
    store.complete_future("old", b"{}", "application/json")
    store.fail_future("new", "x", "user")
    t = now()
    store.db.execute("UPDATE futures SET completed_at = ? WHERE id = 'old'", [t - 3600])
    store.db.execute("UPDATE futures SET created = ? WHERE id = 'pending'", [t - 86400])
    store.db.conn.commit()

    # an age below the floor is raised to MIN_FUTURE_TTL_S: nothing recent goes
    assert store.purge_futures(0, at=t) == 1
    assert store.get_future("old") is None
    assert store.get_future("new") is not None and store.get_future("pending") is not None
    assert store.find_future("r", 1) is None  # the (model_id, seq_id) slot is free again
    assert store.purge_futures(600, at=t + MIN_FUTURE_TTL_S - 1) == 0
    assert store.purge_futures(600, at=t + 601) == 1
    assert store.get_future("pending") is not None  # pending futures are never purged


# -- restart ------------------------------------------------------------------------------

def test_everything_survives_reopen(store, db_path):
    key = store.create_key("alice")
    sid = store.create_session("alice", {"a": "b"}, "0.38.0")
    run = store.create_run(sid, "alice", "m", 8, {"rank": 8})
    p = store.begin_checkpoint(run, "alice", "weights", "w", "/d")
    store.finish_checkpoint(p, 5, "ff")
    sampler = store.create_sampler(sid, "alice", "m", p)
    store.create_future("f", "alice", "save_weights", run, 1)
    store.complete_future("f", b'{"path": "x"}', "application/json")

    store = reopen(store, db_path)
    assert store.tenant_for_key(key) == "alice"
    assert store.get_session(sid)["user_metadata"] == {"a": "b"}
    assert store.get_run(run)["lora_config"] == {"rank": 8}
    assert store.get_checkpoint(p)["status"] == "ready"
    assert store.get_sampler(sampler)["model_path"] == p
    assert store.get_future("f")["result"] == b'{"path": "x"}'
    assert store.find_future(run, 1) == "f"
    # counters continue where they left off
    assert store.next_model_seq(sid) == 1 and store.next_sampler_seq(sid) == 1
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store.close()


def test_to_datetime():
    assert to_datetime(None) is None
    dt = to_datetime(0.0)
    assert dt.tzinfo == UTC and dt.year == 1970
