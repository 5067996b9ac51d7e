"""Runs and checkpoints survive the daemon's stop, clean or SIGKILL, and training resumes."""

from __future__ import annotations

import signal

import httpx
import pytest
from daemon import Daemon, make_key

tinker = pytest.importorskip("tinker")
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


def test_restart_keeps_runs_and_checkpoints(tiny_dir, tmp_path):
    """A clean stop (SIGTERM), then a SIGKILL of the daemon that came back: one lineage of
    three daemons on one data dir (each restart also carries the earlier run along)."""
    key = make_key(tmp_path, "carol")
    d = Daemon(tiny_dir, tmp_path, tmp_path / "log1")
    try:
        for i, sig in enumerate((signal.SIGTERM, signal.SIGKILL)):
            was = _before_stop(d, key, tiny_dir)
            d.stop(sig)
            d = Daemon(tiny_dir, tmp_path, tmp_path / f"log{i + 2}")
            _after_restart(d, key, was)
    finally:
        d.stop()
