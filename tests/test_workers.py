"""The worker group: torch stays out of the HTTP process, a SIGTERM is a hot restart and a
SIGKILL rolls back to persisted state, idle adapters unload, and a killed lane costs only
its own tenants. (Two ranks of one group: tests/test_worker_pair.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from daemon import Daemon, ctl_status, make_key, run_ctl
from helpers import lora_client, tinker_datums, tinker_logprobs, tinker_step

tinker = pytest.importorskip("tinker")
T = 120
TEXTS = ["the sun and the sea are big.", "a cat.", "one two three four five six seven",
         "blue green"]


def _data(tok, texts=TEXTS):
    return tinker_datums(tok, texts)


_step, _logprobs, _client = tinker_step, tinker_logprobs, lora_client


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_http_process_never_imports_torch(daemon):
    code = ("import sys, twinkled.server.cli, twinkled.server.app, twinkled.core.service, tinker_shim.routes, "
            "twinkled.core.executor, twinkled.core.engine_core, twinkled.workers.supervisor, scheduler; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    # The running daemon has not loaded torch's library; its worker has.
    maps = open(f"/proc/{daemon.proc.pid}/maps").read()
    assert "libtorch" not in maps
    workers = daemon.workers()
    assert len(workers) == 1
    assert "libtorch" in open(f"/proc/{workers[0]}/maps").read()


def test_sigterm_is_a_hot_restart_and_sigkill_rolls_back_to_persisted_state(tiny_dir, tmp_path):
    """One lineage of daemons on one data dir, 2 worker ranks each. SIGTERM: the same
    TrainingClient carries on, on the same model id, with the exact weights. Then SIGKILL:
    the workers die with the daemon (no orphan holds a GPU), the run resumes from its
    persisted state, and a checkpoint damaged while the daemon was down is quarantined.
    The last daemon unloads idle adapters after 1 s (_idle_adapters_are_unloaded_and_
    come_back_on_their_next_request: its own daemon start less)."""
    key = make_key(tmp_path, "carol")
    d = Daemon(tiny_dir, tmp_path, tmp_path / "log1", "--workers", "2")
    sc = tinker.ServiceClient(base_url=d.url, api_key=key)
    tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=4,
                                        seed=5).result(timeout=T)
    data = _data(tc.get_tokenizer())
    _step(tc, data)
    _step(tc, data)
    want = _logprobs(tc, data)
    d.stop(signal.SIGTERM)
    assert d.proc.returncode == 0
    d = Daemon(tiny_dir, tmp_path, tmp_path / "log2", "--workers", "2", port=d.port)
    try:
        assert _logprobs(tc, data) == want
        _step(tc, data)
        assert _logprobs(tc, data) != want

        ckpt = tc.save_state("c1").result(timeout=T).path
        _step(tc, data)
        time.sleep(1.0)  # the write-behind persistence of the last step
        want = _logprobs(tc, data)
        workers = d.workers()
        d.stop(signal.SIGKILL)
        deadline = time.time() + 10
        while any(_alive(p) for p in workers) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in workers)  # they died with it: no orphan holds a GPU

        from twinkled.store import Store

        store = Store(tmp_path / "twinkle.db")
        directory = store.checkpoints.get(ckpt)["dir"]
        store.close()
        weights = f"{directory}/adapter_model.safetensors"
        raw = bytearray(open(weights, "rb").read())
        raw[-3] ^= 0xFF
        open(weights, "wb").write(raw)

        cfg = tmp_path / "idle.toml"
        cfg.write_text("idle_unload_s = 1.0\n")
        d = Daemon(tiny_dir, tmp_path, tmp_path / "log3", "--workers", "2", "--config",
                   str(cfg), port=d.port)
        assert _logprobs(tc, data) == want  # same client, same model id, resumed
        _step(tc, data)
        listed = run_ctl(tmp_path, "checkpoints", "list", "--status", "corrupt", "--json")
        assert ckpt in listed.stdout and "sha256" in listed.stdout
        assert not os.path.exists(directory)  # moved aside, never served
        with pytest.raises(Exception, match="corrupt"):
            sc.create_training_client_from_state(ckpt).result(timeout=T)
        _idle_adapters_are_unloaded_and_come_back_on_their_next_request(d, tc, data)
        sc.close("success").result(timeout=T)  # while the daemon is up: later, it retries ~30 s
    finally:
        d.stop()


def _idle_adapters_are_unloaded_and_come_back_on_their_next_request(d, tc, data) -> None:
    """`d` unloads an adapter idle for 1 s; `tc`'s comes back on its next request."""
    want = _logprobs(tc, data)
    deadline = time.time() + 30
    status = {}
    while time.time() < deadline:
        status = ctl_status(d.data_dir)  # polled: in this process
        # (the log line follows the unload that the status already counts)
        if status["adapters"] == 0 and "unloaded after" in d.log_path.read_text():
            break
        time.sleep(0.2)
    assert status["adapters"] == 0, "the idle adapter was not unloaded"
    assert "unloaded after" in d.log_path.read_text()
    # Its next request reloads it: same weights, and training (and seq_ids) go on.
    assert _logprobs(tc, data) == want
    _step(tc, data)
    assert _logprobs(tc, data) != want


def test_a_killed_lane_costs_only_its_own_tenants(tiny_dir, tmp_path):
    """Two lanes of one CPU worker each: alice's model on lane 0, bob's on lane 1 (placed
    in turn). Lane 1's worker killed mid-step fails bob's step only; alice's, in the same
    moment on lane 0, completes; lane 1 restarts with bob's adapter and both go on."""
    keys = {t: make_key(tmp_path, t) for t in ("alice", "bob")}
    d = Daemon(tiny_dir, tmp_path, tmp_path / "log", "--workers", "2", "--lanes", "2",
               env={"TWINKLED_TEST_STEP_DELAY": "1.0"})
    d.keys = keys
    try:
        alice = _client(d, "alice", tiny_dir, 5)
        bob = _client(d, "bob", tiny_dir, 6)
        data = _data(alice.get_tokenizer())[:2]
        _step(alice, data)
        _step(bob, data)
        status = ctl_status(tmp_path)
        assert [lane["adapters"] for lane in status["lanes"]] == [1, 1]
        lane1 = next(w["pid"] for w in status["workers"] if w["lane"] == 1)
        old = d.workers()
        fa = alice.forward_backward(data, "cross_entropy")
        fb = bob.forward_backward(data, "cross_entropy")
        time.sleep(0.5)  # both lanes mid-step
        os.kill(lane1, signal.SIGKILL)
        with pytest.raises(tinker.RequestFailedError, match="restarted"):
            fb.result(timeout=T)
        assert fa.result(timeout=T).metrics["loss:sum"] > 0
        pids = d.wait_workers(2, old={lane1})
        assert set(old) - {lane1} <= set(pids)  # lane 0's worker was never restarted
        assert _step(bob, data).metrics["loss:sum"] > 0
        assert _step(alice, data).metrics["loss:sum"] > 0
        # Sampling: from bob's weights (on bob's lane) and from the base model (any lane).
        prompt = tinker.types.ModelInput.from_ints(alice.get_tokenizer()("a cat").input_ids)
        params = tinker.types.SamplingParams(max_tokens=3, temperature=0.0)
        sampler = bob.save_weights_and_get_sampling_client().result(timeout=T)
        assert len(sampler.sample(prompt, 1, params).result(timeout=T).sequences[0].tokens) == 3
        base = tinker.ServiceClient(base_url=d.url, api_key=keys["alice"]) \
            .create_sampling_client(base_model=tiny_dir.name).result(timeout=T)
        for _ in range(2):  # base-model samples take turns over the lanes
            assert len(base.sample(prompt, 1, params).result(timeout=T).sequences[0].tokens) == 3
    finally:
        d.stop()
