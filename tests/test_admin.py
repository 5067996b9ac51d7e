"""Operating a live daemon: `twinkled ctl` through the admin endpoint, /metrics, JSON logs."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import pytest
from daemon import Daemon, run_ctl

tinker = pytest.importorskip("tinker")
T = 120


def ctl(data_dir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return run_ctl(data_dir, *args, check=check)


def ctl_json(data_dir: Path, *args: str):
    return json.loads(ctl(data_dir, *args, "--json").stdout)


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


@pytest.fixture(scope="module")
def ops_daemon(tiny_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("ops")
    d = Daemon(tiny_dir, data, data / "twinkled.log", "--log-format", "json")
    yield d
    d.stop()


def _train(url: str, key: str, tiny_dir: Path):
    sc = tinker.ServiceClient(base_url=url, api_key=key)
    tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=4).result(timeout=T)
    ids = tc.get_tokenizer()("the sun and the sea are big.").input_ids
    datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": ids[1:]})
    tc.forward_backward([datum], "cross_entropy").result(timeout=T)
    tc.optim_step(tinker.types.AdamParams(learning_rate=1e-3)).result(timeout=T)
    return tc, datum


def test_ctl_key_round_trip_and_revocation(ops_daemon, tiny_dir):
    data = ops_daemon.data_dir
    assert json.loads((data / "daemon.json").read_text())["url"] == ops_daemon.url
    assert (data / "admin.key").stat().st_mode & 0o777 == 0o600
    made = ctl_json(data, "keys", "create", "--tenant", "olga")
    assert made["tenant"] == "olga" and made["key"].startswith("tml-")
    tc, datum = _train(ops_daemon.url, made["key"], tiny_dir)
    listed = ctl_json(data, "keys", "list", "--tenant", "olga")
    assert len(listed) == 1 and listed[0]["revoked_at"] is None
    ctl(data, "keys", "revoke", listed[0]["key_prefix"])
    assert ctl_json(data, "keys", "list", "--tenant", "olga")[0]["revoked_at"] is not None
    with pytest.raises(tinker.AuthenticationError):  # the very next call: 401
        tc.forward_backward([datum], "cross_entropy").result(timeout=T)


def test_status_runs_and_checkpoints_through_ctl(ops_daemon, tiny_dir):
    data = ops_daemon.data_dir
    key = ctl_json(data, "keys", "create", "--tenant", "pia")["key"]
    tc, _ = _train(ops_daemon.url, key, tiny_dir)
    path = tc.save_state("s1").result(timeout=T).path
    status = ctl_json(data, "status")
    assert status["state"] == "ready" and status["model"] == tiny_dir.name
    assert status["workers"][0]["alive"] and status["workers"][0]["device"] == "cpu"
    assert status["tenants"]["pia"]["served_tokens"] > 0
    text = ctl(data, "status").stdout
    assert "rank 0 cpu" in text and "pia" in text
    runs = ctl_json(data, "runs", "list", "--tenant", "pia")
    assert [r["id"] for r in runs] == [tc.model_id] and runs[0]["live"]
    shown = ctl_json(data, "runs", "show", tc.model_id)
    assert [c["tinker_path"] for c in shown["checkpoints"]] == [path]
    assert ctl_json(data, "checkpoints", "list", "--run", tc.model_id)[0]["status"] == "ready"
    ctl(data, "checkpoints", "delete", path)
    assert ctl_json(data, "checkpoints", "list", "--run", tc.model_id) == []
    ctl(data, "runs", "delete", tc.model_id)
    assert ctl_json(data, "runs", "list", "--tenant", "pia") == []
    bad = ctl(data, "runs", "show", "nope", check=False)
    assert bad.returncode != 0 and "no training run 'nope'" in bad.stderr


def test_admin_endpoint_needs_the_admin_key(ops_daemon):
    for headers in ({}, {"X-Admin-Key": "twa-wrong"}):
        req = urllib.request.Request(f"{ops_daemon.url}/admin/v1/status", data=b"{}",
                                     headers=headers, method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 401
    key = (ops_daemon.data_dir / "admin.key").read_text().strip()
    r = httpx.post(f"{ops_daemon.url}/admin/v1/format_disk", json={},
                   headers={"X-Admin-Key": key})
    assert r.status_code == 400 and "unknown admin command" in r.json()["detail"]


def test_metrics_move_with_training(ops_daemon, tiny_dir):
    data = ops_daemon.data_dir
    key = ctl_json(data, "keys", "create", "--tenant", "quinn")["key"]
    before = scrape(ops_daemon.url)
    _train(ops_daemon.url, key, tiny_dir)
    after = scrape(ops_daemon.url)
    trained = 'twinkle_tokens_trained_total{tenant="quinn"}'
    assert before.get(trained, 0.0) == 0.0 and after[trained] > 0
    steps = 'twinkle_step_seconds_count{kind="train"}'
    assert after[steps] > before.get(steps, 0.0)
    assert after["twinkle_queue_wait_seconds_count"] > before["twinkle_queue_wait_seconds_count"]
    assert after["twinkle_adapters_loaded"] >= 1 and after["twinkle_up"] == 1.0
    assert after["twinkle_worker_restarts_total"] == 0.0
    assert 'twinkle_gpu_memory_bytes{device="cpu",lane="0",rank="0"}' in after
    # The rank's busy time grew by at most the steps' time (it is part of each step).
    busy = 'twinkle_worker_busy_seconds_total{device="cpu",lane="0",rank="0"}'
    grew = after[busy] - before.get(busy, 0.0)
    step_s = 'twinkle_step_seconds_sum{kind="train"}'
    assert 0 < grew <= after[step_s] + after.get('twinkle_step_seconds_sum{kind="barrier"}', 0)
    assert after["twinkle_gather_wait_seconds_count"] > before.get(
        "twinkle_gather_wait_seconds_count", 0.0)
    ok = 'twinkle_requests_total{route="/api/v1/forward_backward",status="200"}'
    assert after[ok] > before.get(ok, 0.0)


def test_the_logprob_gap_shows_in_metrics_and_status(ops_daemon, tiny_dir):
    """Sampled through a trained adapter's sampler, 1 in logprob_gap_every (16) requests is
    scored again by the training forward, the first one included, and the figure comes
    back with the worker's next reply: 18 requests show at least one, about 0 in fp32."""
    data = ops_daemon.data_dir
    key = ctl_json(data, "keys", "create", "--tenant", "sven")["key"]
    tc, _ = _train(ops_daemon.url, key, tiny_dir)
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=T)
    params = tinker.types.SamplingParams(max_tokens=6, temperature=1.0, stop=[])
    for i in range(18):
        sampler.sample(prompt=tinker.types.ModelInput.from_ints([5, 6, 7 + i]), num_samples=1,
                       sampling_params=params).result(timeout=T)
    m = scrape(ops_daemon.url)
    assert m["twinkle_logprob_gap_checks_total"] >= 1 and m["twinkle_logprob_gap_window"] >= 1
    assert 0 <= m["twinkle_logprob_gap_mean_nats"] <= m["twinkle_logprob_gap_max_nats"] < 1e-4
    gap = ctl_json(data, "status")["logprob_gap"]
    assert gap["checked"] >= 1 and 0 <= gap["mean"] <= gap["max"] < 1e-4
    assert "logprob gap, sampler vs trainer: mean" in ctl(data, "status").stdout


def test_drain_refuses_new_work_then_undo(ops_daemon, tiny_dir):
    data = ops_daemon.data_dir
    key = ctl_json(data, "keys", "create", "--tenant", "rosa")["key"]
    assert ctl_json(data, "drain", "--timeout", "30")["drained"] is True
    assert ops_daemon.health()["status"] == "draining"
    with httpx.Client(base_url=f"{ops_daemon.url}/api/v1", headers={"X-API-Key": key}) as h:
        sid = h.post("/create_session", json={}).json()["session_id"]
        r = h.post("/create_model", json={"session_id": sid, "model_seq_id": 0,
                                          "base_model": tiny_dir.name,
                                          "lora_config": {"rank": 4}})
        assert r.status_code == 503 and "draining" in r.json()["detail"]
        # The OpenAI face: a 503 in its own shape, which OpenAI clients retry.
        r = h.post(f"{ops_daemon.url}/oai/api/v1/completions", timeout=60,
                   headers={"Authorization": f"Bearer {key}"},
                   json={"model": tiny_dir.name, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["Retry-After"]
        assert r.json()["error"]["code"] == "draining"
    ctl(data, "drain", "--undo")
    assert ops_daemon.health()["status"] == "ok"
    _train(ops_daemon.url, key, tiny_dir)


def test_log_lines_are_json_with_the_request_fields(ops_daemon):
    ops_daemon.health()
    # An admin request of its own (ctl through the daemon): the module's other tests may
    # run in another process, or after this one.
    ctl(ops_daemon.log_path.parent, "status")
    deadline, requests = time.time() + 10, []
    while time.time() < deadline:  # the access line is written as the answer goes out
        lines = [json.loads(x) for x in ops_daemon.log_path.read_text().splitlines()
                 if x.startswith("{")]
        requests = [x for x in lines if "request_id" in x]
        # ctl's, through the daemon (other tests' admin calls may have been refused)
        mine = [x for x in requests if x["tenant"] == "(admin)" and x["status"] == 200]
        if mine:
            break
        time.sleep(0.2)
    assert requests, "no request lines"
    h = mine[-1]
    assert h["status"] == 200 and h["method"] == "POST" and re.fullmatch(r"[0-9a-f]{12}",
                                                                           h["request_id"])
    assert not any(x["route"] == "/api/v1/healthz" for x in requests)  # polls: debug only


def test_ctl_without_a_daemon_uses_the_data_dir(tmp_path):
    made = ctl_json(tmp_path, "--create", "keys", "create", "--tenant", "sam")
    assert ctl_json(tmp_path, "keys", "list")[0]["tenant"] == "sam" and made["key"]
    down = ctl(tmp_path, "status", check=False)
    assert down.returncode != 0 and "needs the running daemon" in down.stderr
    drain = ctl(tmp_path, "drain", check=False)
    assert drain.returncode != 0 and "needs the running daemon" in drain.stderr


def test_config_check_cli(tmp_path):
    """`twinkled config check FILE`, through click's runner in this process (the command's
    own code and exit status, less a Python start each)."""
    from click.testing import CliRunner

    from twinkled.server.cli import main

    good = Path(__file__).resolve().parents[1] / "ops" / "twinkled.toml"
    ok = CliRunner().invoke(main, ["config", "check", str(good)])
    assert ok.exit_code == 0 and ok.stdout.strip() == "ok"
    bad = tmp_path / "bad.toml"
    bad.write_text('prot = 8000\ntoken_budget = "big"\n')
    out = CliRunner().invoke(main, ["config", "check", str(bad)])
    assert out.exit_code == 1 and "prot" in out.stdout and "port" in out.stdout
    assert "token_budget" in out.stdout


def test_status_of_a_stopped_daemon_is_its_last_one(ops_daemon, tiny_dir):
    """The file's last test: it stops the module's daemon (a daemon start less than one
    of its own)."""
    data = ops_daemon.data_dir
    assert ctl_json(data, "status")["running"] is True

    from twinkled.store import Store

    # The status row the daemon writes (at its start, then every 2 s): once there is one,
    # not a 2.5 s wait for the next.
    store = Store(data / "twinkle.db")
    deadline = time.monotonic() + 30
    while store.status.get() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    store.close()
    ops_daemon.stop()
    last = ctl_json(data, "status")
    assert last["running"] is False and last["model"] == tiny_dir.name and last["age_seconds"] >= 0
    assert "NOT RUNNING" in ctl(data, "status").stdout
