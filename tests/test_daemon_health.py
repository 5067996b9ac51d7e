"""healthz answers whatever the model's state; a model that fails to load is reported."""

from __future__ import annotations

import json
import shutil
import time
import urllib.request

import httpx
from daemon import Daemon, make_key


def test_a_model_that_fails_to_load_is_reported_not_fatal(tiny_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    key = make_key(tmp_path / "data", "alice")
    d = Daemon(broken, tmp_path / "data", tmp_path / "log", wait=False)
    try:
        deadline, health = time.time() + 60, None
        while time.time() < deadline:
            health = d.health()
            if health and health["status"] == "failed":
                break
            time.sleep(0.2)
        assert health["status"] == "failed" and health["error"]
        # ... and the daemon still answers, with a clear 4xx instead of hanging clients.
        with httpx.Client(base_url=f"{d.url}/api/v1", headers={"X-API-Key": key}) as http:
            sid = http.post("/create_session", json={}).json()["session_id"]
            r = http.post("/create_model", json={"session_id": sid, "model_seq_id": 0,
                                                 "lora_config": {"rank": 4}})
            assert r.status_code == 400 and "failed to load" in r.json()["detail"]
    finally:
        d.stop()


def test_healthz_needs_no_key_and_names_the_model(daemon, tiny_dir):
    with urllib.request.urlopen(f"{daemon.url}/api/v1/healthz") as r:
        body = json.loads(r.read())
    assert body == {"status": "ok", "model": tiny_dir.name}


def test_sigusr2_logs_what_every_task_waits_for(daemon):
    """An operator's look inside a daemon that answers but makes no progress."""
    import os
    import signal

    os.kill(daemon.proc.pid, signal.SIGUSR2)
    deadline = time.time() + 30
    while time.time() < deadline:
        text = daemon.log_path.read_text(errors="replace")
        if "SIGUSR2: the daemon's tasks" in text:
            break
        time.sleep(0.2)
    assert "SIGUSR2: the daemon's tasks" in text
    after = text.split("SIGUSR2: the daemon's tasks", 1)[1]
    assert "Stack for <Task" in after  # each task's stack follows
    assert daemon.health()["status"] == "ok"  # and the daemon goes on
