"""The unmodified tinker client against `twinkled serve` on a tiny Qwen3-MoE (8 experts,
top-2): training lowers the loss, sampling uses the adapter, and two expert-parallel CPU
ranks (--workers 2 --ep 2) give what one rank gives."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

tinker = pytest.importorskip("tinker")
os.environ.setdefault("TINKER_TELEMETRY", "0")

T = 120
TEXTS = ["the sun and the sea are big.", "hello world from twinkle, yes."]


def _run(daemon, model_dir) -> dict:
    from daemon import make_key

    sc = tinker.ServiceClient(base_url=daemon.url, api_key=make_key(daemon.data_dir, "alice"))
    tc = sc.create_lora_training_client(base_model=model_dir.name, rank=8, seed=0).result(timeout=T)
    tok = tc.get_tokenizer()
    data = []
    for text in TEXTS:
        ids = tok(text).input_ids
        data.append(tinker.types.Datum(
            model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)}))
    losses = []
    for _ in range(4):
        out = tc.forward_backward(data, "cross_entropy").result(timeout=T)
        losses.append(out.metrics["loss:sum"])
        tc.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result(timeout=T)
    logprobs = [o["logprobs"].tolist() for o in
                tc.forward(data, "cross_entropy").result(timeout=T).loss_fn_outputs]
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=T)
    prompt = tinker.types.ModelInput.from_ints(tok("the sun").input_ids)
    greedy = tinker.types.SamplingParams(max_tokens=6, temperature=0.0)
    seq = sampler.sample(prompt, 1, greedy).result(timeout=T).sequences[0]
    return {"losses": losses, "logprobs": logprobs, "tokens": seq.tokens, "lp": seq.logprobs}


def test_moe_training_and_expert_parallel_ranks_match_one(moe_dir, tmp_path):
    from daemon import Daemon

    results = {}
    for name, extra in (("one", ()), ("ep2", ("--workers", "2", "--ep", "2"))):
        data = tmp_path / name
        d = Daemon(moe_dir, data, tmp_path / f"{name}.log", *extra)
        try:
            results[name] = _run(d, moe_dir)
        finally:
            d.stop()
    one, ep2 = results["one"], results["ep2"]
    assert one["losses"][-1] < 0.7 * one["losses"][0], one["losses"]
    assert len(one["tokens"]) == 6
    assert ep2["tokens"] == one["tokens"]
    assert ep2["losses"] == pytest.approx(one["losses"], rel=1e-4)
    for x, y in zip(ep2["logprobs"], one["logprobs"], strict=True):
        assert x == pytest.approx(y, abs=1e-4)
    assert ep2["lp"] == pytest.approx(one["lp"], abs=1e-4)


def test_ep_that_does_not_divide_the_ranks_is_refused(moe_dir, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "twinkled", "serve", "--model", str(moe_dir), "--data-dir",
         str(tmp_path), "--device", "cpu", "--workers", "2", "--ep", "3"],
        capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "--ep 3 must divide the 2 worker ranks" in out.stderr
