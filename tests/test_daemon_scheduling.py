"""The daemon schedules through scheduler/: quotas hold work back, ctl sets and shows them."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
from daemon import make_key

tinker = pytest.importorskip("tinker")


def ctl(data_dir, *args) -> str:
    return subprocess.run([sys.executable, "-m", "twinkled", "ctl", "--data-dir", str(data_dir),
                           *args], check=True, capture_output=True, text=True).stdout


def status_when(data_dir, ready, timeout: float = 30) -> dict:
    """The running daemon's status (`ctl status --json`, live, not the row it writes every
    2 s) once `ready` holds for it, or at the deadline (the caller's asserts say what is
    wrong)."""
    deadline = time.monotonic() + timeout
    while True:
        status = json.loads(ctl(data_dir, "status", "--json"))
        if ready(status) or time.monotonic() > deadline:
            return status
        time.sleep(0.2)


def test_quota_pauses_training_and_refuses_samples(daemon, tiny_dir):
    key = make_key(daemon.data, "carol")
    ctl(daemon.data, "tenants", "set", "carol", "--max-queued-requests", "1", "--weight", "2")
    listed = json.loads(ctl(daemon.data, "tenants", "list", "--json"))
    assert {"name": "carol", "weight": 2.0} .items() <= next(
        t for t in listed if t["name"] == "carol").items()
    # No wait: through the running daemon's admin API, a setting is in force when ctl returns.
    with httpx.Client(base_url=f"{daemon.url}/api/v1", headers={"X-API-Key": key},
                      timeout=60) as http:
        sid = http.post("/create_session", json={}).json()["session_id"]
        r = http.post("/create_model", json={"session_id": sid, "model_seq_id": 0,
                                             "base_model": tiny_dir.name,
                                             "lora_config": {"rank": 4}}).json()
        while http.post("/retrieve_future", json={"request_id": r["request_id"]}).json().get(
                "type") == "try_again":
            pass
        model = f"{sid}:train:0"
        # seq 5 waits on a gap and fills carol's one-request quota ...
        http.post("/optim_step", json={"model_id": model, "seq_id": 5, "adam_params": {}})
        # ... so seq 6 is held back, and its polls say why.
        held = http.post("/optim_step", json={"model_id": model, "seq_id": 6,
                                              "adam_params": {}}).json()
        poll = http.post("/retrieve_future", json={"request_id": held["request_id"]}).json()
        assert poll["type"] == "try_again" and poll["queue_state"] == "paused_rate_limit"
        sampler = http.post("/create_sampling_session", json={
            "session_id": sid, "sampling_session_seq_id": 0,
            "base_model": tiny_dir.name}).json()["sampling_session_id"]
        r = http.post("/asample", json={
            "sampling_session_id": sampler, "num_samples": 1, "seq_id": 0,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]},
            "sampling_params": {"max_tokens": 2}})
        assert r.status_code == 429 and "quota" in r.json()["detail"]
        # The OpenAI face says the same in its own shape: 429, rate_limit_exceeded.
        r = httpx.post(f"{daemon.url}/oai/api/v1/completions", timeout=60,
                       headers={"Authorization": f"Bearer {key}"},
                       json={"model": tiny_dir.name, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 429 and r.headers["Retry-After"]
        err = r.json()["error"]
        assert (err["type"], err["code"]) == ("rate_limit_error", "rate_limit_exceeded")
        assert "quota" in err["message"]
    status = status_when(daemon.data, lambda s: s["tenants"].get("carol", {}).get("paused") == 1)
    carol = status["tenants"]["carol"]
    assert carol["queued_requests"] == 1 and carol["paused"] == 1 and carol["weight"] == 2.0
    assert status["state"] == "ready"
    text = ctl(daemon.data, "status")
    assert "carol" in text and "share" in text


def test_rank_cap_is_a_clear_refusal(daemon, tiny_dir):
    key = make_key(daemon.data, "dave")
    ctl(daemon.data, "tenants", "set", "dave", "--max-rank", "8")  # in force at once
    sc = tinker.ServiceClient(base_url=daemon.url, api_key=key)
    with pytest.raises(tinker.BadRequestError, match="over tenant 'dave'.s cap of 8"):
        sc.create_lora_training_client(base_model=tiny_dir.name, rank=16).result(timeout=60)
    assert sc.create_lora_training_client(base_model=tiny_dir.name, rank=8).result(timeout=60)


def test_status_shows_shares_after_training(daemon, tiny_dir):
    sc = tinker.ServiceClient(base_url=daemon.url, api_key=daemon.keys["bob"])
    tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=4).result(timeout=60)
    d = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([5, 6, 7, 8]),
                           loss_fn_inputs={"target_tokens": [6, 7, 8, 9]})
    before = json.loads(ctl(daemon.data, "status", "--json"))["tenants"].get("bob", {})
    tc.forward_backward([d], "cross_entropy").result(timeout=60)
    tenants = status_when(daemon.data, lambda s: s["tenants"].get("bob", {}).get(
        "served_tokens", 0) > before.get("served_tokens", 0))["tenants"]
    bob = tenants["bob"]
    # Exactly this datum's 4 tokens more; more training time; and the shares are each
    # tenant's part of all training time (the session daemon has served others too).
    assert bob["served_tokens"] - before.get("served_tokens", 0) == 4
    assert bob["served_s"] > before.get("served_s", 0.0)
    total = sum(t["served_s"] for t in tenants.values())
    assert sum(t["share"] for t in tenants.values()) == pytest.approx(1.0)
    assert bob["share"] == pytest.approx(bob["served_s"] / total)


def test_finishing_a_session_unloads_its_adapters(daemon, tiny_dir):
    key = make_key(daemon.data, "erin")
    ctl(daemon.data, "tenants", "set", "erin", "--max-adapters", "1")  # in force at once
    sc = tinker.ServiceClient(base_url=daemon.url, api_key=key)
    tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=4).result(timeout=60)
    d = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([5, 6, 7]),
                           loss_fn_inputs={"target_tokens": [6, 7, 8]})
    tc.forward_backward([d], "cross_entropy").result(timeout=60)
    path = tc.save_state("erin-1").result(timeout=60).path
    with pytest.raises(tinker.BadRequestError, match="quota"):  # one adapter at a time
        sc.create_lora_training_client(base_model=tiny_dir.name, rank=4).result(timeout=60)
    sc.close("success")  # finishing the session frees its adapter ...
    time.sleep(1)
    sc2 = tinker.ServiceClient(base_url=daemon.url, api_key=key)
    resumed = sc2.create_training_client_from_state_with_optimizer(path).result(timeout=60)
    assert resumed.forward([d], "cross_entropy").result(timeout=60).metrics["loss:sum"] > 0
    with httpx.Client(base_url=f"{daemon.url}/api/v1", headers={"X-API-Key": key}) as http:
        r = http.post("/optim_step", json={"model_id": tc.model_id, "seq_id": 99,
                                           "adam_params": {}})
    assert r.status_code == 400 and "not loaded" in r.json()["detail"]  # ... and says so
    sc2.close("success")
