"""Runs and checkpoints survive the daemon's stop, clean or SIGKILL, and training resumes;
a Dimuon model's optimizer state survives a worker kill, a daemon SIGKILL and a hot restart
(through the unmodified tinker client)."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from daemon import Daemon, make_key
from test_tinker_dimuon import _client, _logprobs, _step
from test_tinker_dimuon import _data as _dimuon_data

tinker = pytest.importorskip("tinker")
types = tinker.types
T = 120


def _data(tok):
    ids = tok("the sun and the sea are big.").input_ids
    return [tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": ids[1:]})]


def _before_stop(d: Daemon, key: str, tiny_dir) -> dict:
    """A run with a checkpoint, a sampler checkpoint, a step after them, and a request that
    cannot run before the stop (it waits on a seq gap): what the next daemon must know."""
    sc = tinker.ServiceClient(base_url=d.url, api_key=key)
    tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=4).result(timeout=T)
    data = _data(tc.get_tokenizer())
    adam = tinker.types.AdamParams(learning_rate=1e-2)
    tc.forward_backward(data, "cross_entropy").result(timeout=T)
    tc.optim_step(adam).result(timeout=T)
    path = tc.save_state("ckpt").result(timeout=T).path
    sampler_path = tc.save_weights_for_sampler("s").result(timeout=T).path
    tc.forward_backward(data, "cross_entropy").result(timeout=T)
    tc.optim_step(adam).result(timeout=T)
    want = tc.forward(data, "cross_entropy").result(timeout=T).metrics["loss:sum"]
    with httpx.Client(base_url=f"{d.url}/api/v1", headers={"X-API-Key": key}) as http:
        pending = http.post("/optim_step", json={"model_id": tc.model_id, "seq_id": 99,
                                                 "adam_params": {}}).json()["request_id"]
    return {"model_id": tc.model_id, "data": data, "path": path, "want": want,
            "sampler_path": sampler_path, "pending": pending}


def _after_restart(d: Daemon, key: str, was: dict) -> None:
    sc = tinker.ServiceClient(base_url=d.url, api_key=key)
    rest = sc.create_rest_client()
    runs = [r.training_run_id for r in rest.list_training_runs().result(timeout=T).training_runs]
    assert was["model_id"] in runs
    ckpts = {c.tinker_path
             for c in rest.list_checkpoints(was["model_id"]).result(timeout=T).checkpoints}
    assert ckpts == {was["path"], was["sampler_path"]}
    resumed = sc.create_training_client_from_state_with_optimizer(was["path"]).result(timeout=T)
    resumed.forward_backward(was["data"], "cross_entropy").result(timeout=T)
    resumed.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result(timeout=T)
    got = resumed.forward(was["data"], "cross_entropy").result(timeout=T).metrics["loss:sum"]
    assert got == pytest.approx(was["want"], rel=1e-5)
    # The request cut short by the stop reports a clear error when polled.
    with httpx.Client(base_url=f"{d.url}/api/v1", headers={"X-API-Key": key}) as http:
        r = http.post("/retrieve_future", json={"request_id": was["pending"]}).json()
    assert r["category"] == "server" and "restarted" in r["error"]
    sampler = sc.create_sampling_client(model_path=was["sampler_path"])
    out = sampler.sample(tinker.types.ModelInput.from_ints([5, 6]), 1,
                         tinker.types.SamplingParams(max_tokens=3)).result(timeout=T)
    assert len(out.sequences[0].tokens) == 3


def _crash_pair(d, key: str, tiny_dir):
    """A Dimuon model with three acknowledged steps and pending gradients, and what it must
    reach after its next step: its twin (same seed) ran the same history without a crash."""
    sc = tinker.ServiceClient(base_url=d.url, api_key=key)
    tc, twin = _client(sc, tiny_dir, seed=5), _client(sc, tiny_dir, seed=5)
    data = _dimuon_data(tc.get_tokenizer())
    for model in (tc, twin):
        for _ in range(3):
            _step(model, data, lr=1e-2, beta1=0.8)
        model.forward_backward(data, "cross_entropy").result(timeout=T)
    twin.optim_step(types.DimuonParams(learning_rate=1e-2, beta1=0.8)).result(timeout=T)
    return tc, data, _logprobs(twin, data)


def _after_crash(tc, data, want):
    tc.optim_step(types.DimuonParams(learning_rate=1e-2, beta1=0.8)).result(timeout=T)
    assert _logprobs(tc, data) == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert tc.get_info().optimizer_config.type == "dimuon"


def _recreated_fresh(d, key: str, tiny_dir, data_dir):
    """With no persisted state to load (persist_every = 0, and a create writes none), a
    killed worker's adapter comes back fresh from its config: still Dimuon, so the
    client's next DimuonParams step is accepted."""
    sc = tinker.ServiceClient(base_url=d.url, api_key=key)
    tc = _client(sc, tiny_dir, seed=6)
    data = _dimuon_data(tc.get_tokenizer())
    _step(tc, data)
    live = data_dir / "live" / tc.model_id
    assert not live.exists() or not any(live.iterdir())
    old = d.workers()
    os.kill(old[0], signal.SIGKILL)
    d.wait_workers(1, old=set(old))
    loss, out = _step(tc, data)
    assert out.metrics["step:max"] == 1 and loss > 0  # fresh state, same family


def test_restart_keeps_runs_and_checkpoints(tiny_dir, tmp_path):
    """One lineage of three daemons on one data dir, every way to lose the process that
    held the state: a worker kill, a daemon SIGKILL, a clean stop (SIGTERM, a hot restart).

    carol's runs: before each daemon stop, a run with checkpoints, a step after them and a
    request waiting on a seq gap; the next daemon knows them all (each restart also carries
    the earlier run along). dan's Dimuon model: its momentum comes back on every path. The
    first two daemons persist only at create (persist_every = 1000), so a worker kill and a
    SIGKILL restore from the journal; SIGTERM persists every live adapter. The third runs
    with persistence off (persist_every = 0), where a killed worker's adapter with nothing
    persisted comes back fresh (_recreated_fresh)."""
    cfg = tmp_path / "twinkled.toml"
    cfg.write_text("persist_every = 1000\n")
    carol, dan = make_key(tmp_path, "carol"), make_key(tmp_path, "dan")
    d = Daemon(tiny_dir, tmp_path, tmp_path / "log1", "--config", str(cfg))
    try:
        tc, data, want = _crash_pair(d, dan, tiny_dir)
        old = d.workers()
        os.kill(old[0], signal.SIGKILL)
        d.wait_workers(1, old=set(old))
        _after_crash(tc, data, want)
        assert "replayed" in d.log_path.read_text()

        off = tmp_path / "off.toml"
        off.write_text("persist_every = 0\n")
        for i, (sig, conf) in enumerate(((signal.SIGKILL, cfg), (signal.SIGTERM, off))):
            tc, data, want = _crash_pair(d, dan, tiny_dir)
            was = _before_stop(d, carol, tiny_dir)
            d.stop(sig)
            time.sleep(0.5)
            d = Daemon(tiny_dir, tmp_path, tmp_path / f"log{i + 2}", "--config", str(conf),
                       port=d.port)  # the same clients, on the same model ids
            _after_crash(tc, data, want)
            _after_restart(d, carol, was)
        _recreated_fresh(d, dan, tiny_dir, tmp_path)
    finally:
        d.stop()
