"""Hygiene of the data (issue 11): private file modes, literal key prefixes, atomic
overwrite checks, and the per-tenant storage quota (checkpoints + metadata)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from daemon import Daemon, make_key, run_ctl

from twinkled.protocol.checkpoints import checkpoint_path
from twinkled.protocol.config import Config, check_config
from twinkled.protocol.errors import Conflict, QuotaExceeded, UserError
from twinkled.server.admin import Admin, AdminError
from twinkled.server.perms import private_dir
from twinkled.store import Store

T = 120
GIB = 1024**3


def ctl(data_dir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return run_ctl(data_dir, *args, check=check)


def ctl_json(data_dir: Path, *args: str):
    return json.loads(ctl(data_dir, *args, "--json").stdout)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def loose(root: Path) -> list[str]:
    """Everything under root (root included) that is not exactly 0700 (dirs) / 0600 (files)."""
    bad = []
    for p in [root, *root.rglob("*")]:
        want = 0o700 if p.is_dir() else 0o600
        if not p.is_symlink() and mode(p) != want:
            bad.append(f"{p.relative_to(root.parent)}: {mode(p):04o}")
    return bad


def umask_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    pytest.skip("this kernel does not show a process's umask in /proc")


@pytest.fixture()
def store(tmp_path):
    s = Store(tmp_path / "twinkle.db")
    yield s
    s.close()


def run_of(store: Store, tenant: str, metadata: dict | None = None) -> str:
    sid = store.sessions.create(tenant, metadata, None)
    return store.runs.create(sid, tenant, "m", 4, user_metadata=metadata)


# -- a real daemon: modes after training and a checkpoint ----------------------------------


@pytest.fixture(scope="module")
def hygiene_daemon(tiny_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("hygiene")
    data = base / "data"  # made by ctl below, then loosened as an older release left it
    key = make_key(data, "alice")
    data.chmod(0o755)
    (data / "twinkle.db").chmod(0o644)
    d = Daemon(tiny_dir, data, base / "twinkled.log")
    d.key = key
    yield d
    d.stop()


@pytest.fixture(scope="module")
def trained(hygiene_daemon, tiny_dir):
    """alice trained one step and saved a checkpoint through the real tinker client."""
    tinker = pytest.importorskip("tinker")
    sc = tinker.ServiceClient(base_url=hygiene_daemon.url, api_key=hygiene_daemon.key)
    tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=4).result(timeout=T)
    ids = tc.get_tokenizer()("the sun and the sea are big.").input_ids
    datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": ids[1:]})
    tc.forward_backward([datum], "cross_entropy").result(timeout=T)
    tc.optim_step(tinker.types.AdamParams(learning_rate=1e-3)).result(timeout=T)
    path = tc.save_state("step-1").result(timeout=T).path
    live = hygiene_daemon.data_dir / "live"
    deadline = time.time() + T  # persistence of the live adapter may trail the reply
    while time.time() < deadline and not any(p.is_file() for p in live.rglob("*")):
        time.sleep(0.2)
    return tc, path


def test_daemon_data_dir_is_private_after_training_and_a_save(hygiene_daemon, trained):
    data = hygiene_daemon.data_dir
    # the loosened data dir and database were tightened at start ...
    assert mode(data) == 0o700 and mode(data / "twinkle.db") == 0o600
    # ... and everything written since is private: the daemon's own files, the workers'
    # live state and checkpoint files.
    for name in ("twinkle.db-wal", "twinkle.db-shm", "daemon.json", "admin.key"):
        assert (data / name).is_file(), name
    assert any(p.is_file() for p in (data / "live").rglob("*")), "no live state written"
    ckpt = [p for p in (data / "checkpoints").rglob("*") if p.is_file()]
    assert any(p.name.endswith(".safetensors") for p in ckpt), "no checkpoint files written"
    assert loose(data) == []


def test_workers_inherit_the_private_umask(hygiene_daemon, trained):
    workers = hygiene_daemon.workers()
    assert workers
    assert umask_of(hygiene_daemon.proc.pid) == 0o077
    assert [umask_of(pid) for pid in workers] == [0o077] * len(workers)


def test_ctl_tenants_list_shows_storage_through_the_daemon(hygiene_daemon, trained):
    data = hygiene_daemon.data_dir
    _, path = trained
    listed = {t["name"]: t for t in ctl_json(data, "tenants", "list")}
    alice = listed["alice"]
    row = ctl_json(data, "checkpoints", "list", "--tenant", "alice")
    sizes = sum(c["size_bytes"] or 0 for c in row)
    assert path in {c["tinker_path"] for c in row} and sizes > 0
    assert alice["storage_used_bytes"] >= sizes  # the checkpoint, plus any metadata
    assert alice["storage_quota_bytes"] == 50 * GIB
    # A per-tenant quota goes through the daemon (which refreshes its tenants with it).
    ctl(data, "tenants", "set", "alice", "--max-storage-bytes", str(5 * GIB))
    listed = {t["name"]: t for t in ctl_json(data, "tenants", "list")}
    assert listed["alice"]["storage_quota_bytes"] == 5 * GIB
    assert listed["alice"]["max_storage_bytes"] == 5 * GIB
    assert "of 5.0 GiB" in ctl(data, "tenants", "list").stdout


# -- modes of what ctl creates -----------------------------------------------------------


def test_ctl_creates_a_private_data_dir(tmp_path):
    data = tmp_path / "new" / "data"
    ctl(data, "--create", "keys", "create", "--tenant", "sam")
    assert mode(data) == 0o700
    assert (data / "twinkle.db").is_file()
    assert loose(data) == []


def test_ctl_tightens_its_own_loose_data_dir_and_leaves_other_files(tmp_path):
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    data.chmod(0o755)
    notes = data / "notes.txt"  # not the daemon's: left as it is
    notes.write_text("x")
    notes.chmod(0o644)
    ctl(data, "--create", "keys", "create", "--tenant", "sam")
    assert mode(data) == 0o700 and mode(data / "twinkle.db") == 0o600
    assert mode(notes) == 0o644


def test_ctl_in_process_restores_the_umask(tmp_path):
    from twinkled.server.cli import main

    before = os.umask(0o022)
    try:
        result = CliRunner().invoke(main, ["ctl", "--data-dir", str(tmp_path / "d"), "--create",
                                           "keys", "create", "--tenant", "sam"])
        assert result.exit_code == 0, result.output
        assert os.umask(0o022) == 0o022  # what ctl set was undone when it finished
        assert mode(tmp_path / "d" / "twinkle.db") == 0o600  # but ctl itself wrote 0600
    finally:
        os.umask(before)


def test_private_dir_tightens_the_daemons_entries(tmp_path):
    data = tmp_path / "d"
    data.mkdir()
    data.chmod(0o750)
    for name in ("twinkle.db", "daemon.json", "other.log"):
        (data / name).write_text("x")
        (data / name).chmod(0o644)
    (data / "live").mkdir()
    (data / "live").chmod(0o755)
    private_dir(data)
    assert mode(data) == 0o700
    assert mode(data / "twinkle.db") == 0o600 and mode(data / "daemon.json") == 0o600
    assert mode(data / "live") == 0o700
    assert mode(data / "other.log") == 0o644


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a dir owned by another user")
def test_private_dir_warns_and_goes_on_for_a_dir_it_does_not_own(tmp_path, caplog):
    data = tmp_path / "theirs"
    data.mkdir()
    data.chmod(0o755)
    os.chown(data, 65534, 65534)
    with caplog.at_level("WARNING", logger="twinkled"):
        assert private_dir(data) == data
    assert mode(data) == 0o755
    assert "not by this user" in caplog.text


# -- ctl keys revoke: literal prefixes ----------------------------------------------------


@pytest.mark.parametrize("pattern", ["%%%%%%", "______", "%", "tml-%", "tml-_"])
def test_revoke_prefix_is_literal_not_a_like_pattern(store, pattern):
    key = store.tenants.create_key("alice")
    if len(pattern) < 6 and not pattern.startswith("tml-"):
        with pytest.raises(ValueError, match="too short"):
            store.tenants.revoke_key(pattern)
    else:
        assert store.tenants.revoke_key(pattern) is False
    assert store.tenants.for_key(key) == "alice"


def test_revoke_wildcards_inside_a_real_prefix_match_nothing(store, tmp_path):
    keys = [store.tenants.create_key("alice") for _ in range(3)]
    prefixes = [r["key_prefix"] for r in store.tenants.list_keys()]
    first = prefixes[0]
    for pattern in (first[:6] + "%", first[:5] + "_", first[:6] + "_" * 4, "%" + first[1:8]):
        assert store.tenants.revoke_key(pattern) is False, pattern
    assert all(store.tenants.for_key(k) == "alice" for k in keys)
    with pytest.raises(AdminError, match="no active key matches"):
        Admin(store, tmp_path).keys_revoke("%%%%%%%%")
    assert store.tenants.revoke_key(first.upper()[:8]) is True  # a real prefix still works
    assert sum(store.tenants.for_key(k) is None for k in keys) == 1


# -- overwrite checks: atomic under concurrency --------------------------------------------


def _race(db: Path, run: str, n: int, **kw) -> tuple[list[str], list[Exception]]:
    """n threads, each with its own connection, begin the same checkpoint at once."""
    stores = [Store(db) for _ in range(n)]
    barrier = threading.Barrier(n)
    won, lost = [], []

    def go(s: Store) -> None:
        barrier.wait()
        try:
            won.append(s.checkpoints.begin(run, "alice", "weights", "same", "/d/x", **kw))
        except Exception as e:  # noqa: BLE001 - collected and checked below
            lost.append(e)

    threads = [threading.Thread(target=go, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in stores:
        s.close()
    return won, lost


def test_concurrent_saves_to_one_name_one_wins(tmp_path):
    db = tmp_path / "twinkle.db"
    s = Store(db)
    run = run_of(s, "alice")
    won, lost = _race(db, run, 12)
    assert len(won) == 1 and len(lost) == 11
    assert all(isinstance(e, Conflict) for e in lost), lost
    assert s.checkpoints.get(won[0])["status"] == "writing"
    # while it is being written, overwrite=True does not let a second writer in either
    won2, lost2 = _race(db, run, 8, overwrite=True)
    assert won2 == [] and all(isinstance(e, Conflict) for e in lost2) and len(lost2) == 8
    # once ready: refused without overwrite; overwriters all get through (the saves of one
    # run's path run one after another, in its seq_id order), and the ready version is
    # served as it is until one of them is written
    s.checkpoints.finish(won[0], 10, "00")
    won3, lost3 = _race(db, run, 8)
    assert won3 == [] and all("overwrite=True" in str(e) for e in lost3)
    won4, lost4 = _race(db, run, 8, overwrite=True)
    assert len(won4) == 8 and lost4 == []
    assert s.checkpoints.get(won[0])["status"] == "ready"
    assert s.checkpoints.get(won[0])["sha256"] == "00"
    s.close()


def test_corrupt_checkpoint_may_be_saved_again(store):
    run = run_of(store, "alice")
    p = store.checkpoints.begin(run, "alice", "weights", "w", "/d/1")
    store.checkpoints.mark_corrupt(p, "write failed")
    assert store.checkpoints.begin(run, "alice", "weights", "w", "/d/2") == p
    assert store.checkpoints.get(p)["status"] == "writing"


# -- the storage quota -------------------------------------------------------------------


def test_storage_used_counts_checkpoint_sizes_and_metadata(store):
    meta = {"note": "é" * 10}  # bytes, not characters
    meta_bytes = len(json.dumps(meta).encode())
    assert store.checkpoints.storage_used("alice") == 0
    run = run_of(store, "alice", meta)  # a session and a run, both with metadata
    assert store.checkpoints.storage_used("alice") == 2 * meta_bytes
    p1 = store.checkpoints.begin(run, "alice", "weights", "a", "/d/a", user_metadata=meta)
    store.checkpoints.finish(p1, 1000, "00")
    p2 = store.checkpoints.begin(run, "alice", "sampler_weights", "b", "/d/b")
    store.checkpoints.finish(p2, 234, "00")
    p3 = store.checkpoints.begin(run, "alice", "weights", "c", "/d/c")  # writing: no size yet
    assert store.checkpoints.storage_used("alice") == 3 * meta_bytes + 1234
    store.checkpoints.mark_corrupt(p3, "x")
    other = run_of(store, "bob", {"big": "x" * 5000})
    store.checkpoints.finish(store.checkpoints.begin(other, "bob", "weights", "z", "/d/z"), 99, "0")
    assert store.checkpoints.storage_used("alice") == 3 * meta_bytes + 1234  # bob's is not alice's
    store.checkpoints.delete(p1)
    assert store.checkpoints.storage_used("alice") == 2 * meta_bytes + 234


def test_quota_refuses_a_save_at_the_quota(store):
    run = run_of(store, "alice")
    p = store.checkpoints.begin(run, "alice", "weights", "a", "/d/a", quota_bytes=1000)
    store.checkpoints.finish(p, 999, "00")
    used = store.checkpoints.storage_used("alice")
    assert used == 999
    # under the quota: a save starts
    q = store.checkpoints.begin(run, "alice", "weights", "b", "/d/b", quota_bytes=1000)
    store.checkpoints.finish(q, 1, "00")
    # at the quota: refused, with a message that says what to do, and nothing recorded
    with pytest.raises(QuotaExceeded) as e:
        store.checkpoints.begin(run, "alice", "weights", "c", "/d/c", quota_bytes=1000)
    assert isinstance(e.value, UserError)
    msg = str(e.value)
    assert "'alice'" in msg and "1000 B of its 1000 B storage quota" in msg
    assert "checkpoints delete" in msg and "delete_checkpoint" in msg
    assert store.checkpoints.get(checkpoint_path(run, "weights", "c")) is None
    # overwriting frees what it replaces, so it is allowed at the quota
    assert store.checkpoints.begin(run, "alice", "weights", "a", "/d/a2", overwrite=True,
                                   quota_bytes=1000) == p
    # no limit: None, or a quota of 0 or less
    for quota in (None, 0, -1):
        store.checkpoints.begin(run, "alice", "weights", f"n{quota}", "/d/n", quota_bytes=quota)
    # metadata counts toward it too
    run2 = run_of(store, "carol", {"blob": "y" * 2000})
    with pytest.raises(QuotaExceeded, match="GiB|KiB"):
        store.checkpoints.begin(run2, "carol", "weights", "a", "/d/ca", quota_bytes=1024)


def test_quota_message_in_gib(store):
    run = run_of(store, "alice")
    p = store.checkpoints.begin(run, "alice", "weights", "a", "/d/a")
    store.checkpoints.finish(p, int(51 * GIB), "00")
    with pytest.raises(QuotaExceeded, match=r"uses 51\.0 GiB of its 50\.0 GiB storage quota"):
        store.checkpoints.begin(run, "alice", "weights", "b", "/d/b", quota_bytes=50 * GIB)


def test_tenant_storage_quota_row_over_default(store):
    store.tenants.ensure("alice")
    assert store.checkpoints.storage_quota("alice", 50 * GIB) == 50 * GIB
    assert store.checkpoints.storage_quota("nobody", 123) == 123
    assert store.checkpoints.storage_quota("alice", None) is None
    assert store.checkpoints.storage_quota("alice", 0) is None
    store.tenants.set("alice", max_storage_bytes=2048)
    assert store.checkpoints.storage_quota("alice", 50 * GIB) == 2048
    store.tenants.set("alice", max_storage_bytes=-1)
    assert store.checkpoints.storage_quota("alice", 50 * GIB) is None
    store.tenants.set("alice", max_storage_bytes=0)  # cleared: the default again
    assert store.checkpoints.storage_quota("alice", 50 * GIB) == 50 * GIB


def test_config_storage_quota_default(tmp_path):
    assert Config().tenant_max_storage_bytes == 53687091200
    cfg = Config(tenant_max_storage_bytes=1000, tenants={"a": {"max_storage_bytes": 5},
                                                          "u": {"max_storage_bytes": -1}})
    assert cfg.storage_quota_default("a") == 5
    assert cfg.storage_quota_default("u") is None
    assert cfg.storage_quota_default("z") == 1000
    assert Config(tenant_max_storage_bytes=0).storage_quota_default("z") is None
    good = tmp_path / "good.toml"
    good.write_text("tenant_max_storage_bytes = 0\n[tenants.a]\nmax_storage_bytes = -1\n")
    assert check_config(good) == []
    bad = tmp_path / "bad.toml"
    bad.write_text('tenant_max_storage_bytes = "50G"\n[tenants.a]\nmax_storage_bytes = 0\n')
    problems = check_config(bad)
    assert len(problems) == 2 and problems[0].startswith("tenant_max_storage_bytes:")
    assert problems[1].startswith("tenants.a.max_storage_bytes:")


def test_ctl_tenants_list_shows_storage_without_a_daemon(tmp_path):
    data = tmp_path / "data"
    ctl(data, "--create", "keys", "create", "--tenant", "alice")
    s = Store(data / "twinkle.db")
    run = run_of(s, "alice")
    s.checkpoints.finish(s.checkpoints.begin(run, "alice", "weights", "a", "/d/a"), 3 * 1024**2,
                        "00")
    s.close()
    alice = ctl_json(data, "tenants", "list")[0]
    assert alice["storage_used_bytes"] == 3 * 1024**2
    assert alice["storage_quota_bytes"] == 50 * GIB
    assert "3.0 MiB of 50.0 GiB" in ctl(data, "tenants", "list").stdout
    ctl(data, "tenants", "set", "alice", "--max-storage-bytes", "-1")
    assert ctl_json(data, "tenants", "list")[0]["storage_quota_bytes"] is None
    assert "3.0 MiB of unlimited" in ctl(data, "tenants", "list").stdout
