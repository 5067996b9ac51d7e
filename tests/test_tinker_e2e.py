"""The unmodified tinker 0.38 client against a real `twinkled serve` process."""

from __future__ import annotations

import os

import pytest
from daemon import Daemon, make_key

tinker = pytest.importorskip("tinker")
os.environ.setdefault("TINKER_TELEMETRY", "0")

TIMEOUT = 120


@pytest.fixture(scope="module")
def daemon(tiny_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("data")
    d = Daemon(tiny_dir, data, data / "twinkled.log")
    d.keys = {t: make_key(data, t) for t in ("alice", "bob")}
    yield d
    d.stop()


def _service(daemon, tenant="alice"):
    return tinker.ServiceClient(base_url=daemon.url, api_key=daemon.keys[tenant])


def _datum(tokenizer, text: str):
    ids = tokenizer(text).input_ids
    return tinker.types.Datum(
        model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})


def test_sft_loop_trains_and_samples(daemon, tiny_dir):
    sc = _service(daemon)
    tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=8).result(timeout=TIMEOUT)
    tok = tc.get_tokenizer()
    data = [_datum(tok, "the sun and the sea are big"), _datum(tok, "hello world from twinkle")]
    losses = []
    for _ in range(8):
        fb = tc.forward_backward(data, "cross_entropy").result(timeout=TIMEOUT)
        losses.append(fb.metrics["loss:sum"])
        opt = tc.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result(timeout=TIMEOUT)
        assert "grad_norm:mean" in opt.metrics
    assert losses[-1] < 0.7 * losses[0]
    assert len(fb.loss_fn_outputs) == 2
    assert len(fb.loss_fn_outputs[0]["logprobs"].tolist()) == len(data[0].model_input.to_ints())

    # forward() equals the logprobs forward_backward reports, and changes nothing.
    fwd1 = tc.forward(data, "cross_entropy").result(timeout=TIMEOUT)
    fwd2 = tc.forward(data, "cross_entropy").result(timeout=TIMEOUT)
    assert fwd1.metrics["loss:sum"] == pytest.approx(fwd2.metrics["loss:sum"])

    sampler = tc.save_weights_and_get_sampling_client()
    prompt = tinker.types.ModelInput.from_ints(tok("the sun").input_ids)
    params = tinker.types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
    out = sampler.sample(prompt, num_samples=2, sampling_params=params).result(timeout=TIMEOUT)
    assert len(out.sequences) == 2 and len(out.sequences[0].tokens) == 6
    assert out.sequences[0].tokens == out.sequences[1].tokens  # greedy
    sc.close("success")
