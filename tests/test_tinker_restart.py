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


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_restart_keeps_runs_and_checkpoints(tiny_dir, tmp_path, sig):
    key = make_key(tmp_path, "carol")
    d = Daemon(tiny_dir, tmp_path, tmp_path / "log1")
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
    # A request that cannot run before the stop (it waits on a seq gap).
    with httpx.Client(base_url=f"{d.url}/api/v1", headers={"X-API-Key": key}) as http:
        pending = http.post("/optim_step", json={"model_id": tc.model_id, "seq_id": 99,
                                                 "adam_params": {}}).json()["request_id"]
    d.stop(sig)

    d2 = Daemon(tiny_dir, tmp_path, tmp_path / "log2")
    try:
        sc2 = tinker.ServiceClient(base_url=d2.url, api_key=key)
        rest = sc2.create_rest_client()
        runs = [r.training_run_id for r in rest.list_training_runs().result(timeout=T).training_runs]
        assert tc.model_id in runs
        ckpts = {c.tinker_path for c in rest.list_checkpoints(tc.model_id).result(timeout=T).checkpoints}
        assert ckpts == {path, sampler_path}
        resumed = sc2.create_training_client_from_state_with_optimizer(path).result(timeout=T)
        resumed.forward_backward(data, "cross_entropy").result(timeout=T)
        resumed.optim_step(adam).result(timeout=T)
        got = resumed.forward(data, "cross_entropy").result(timeout=T).metrics["loss:sum"]
        assert got == pytest.approx(want, rel=1e-5)
        # The request cut short by the stop reports a clear error when polled.
        with httpx.Client(base_url=f"{d2.url}/api/v1", headers={"X-API-Key": key}) as http:
            r = http.post("/retrieve_future", json={"request_id": pending}).json()
        assert r["category"] == "server" and "restarted" in r["error"]
        sampler = sc2.create_sampling_client(model_path=sampler_path)
        out = sampler.sample(tinker.types.ModelInput.from_ints([5, 6]), 1,
                             tinker.types.SamplingParams(max_tokens=3)).result(timeout=T)
        assert len(out.sequences[0].tokens) == 3
    finally:
        d2.stop()
