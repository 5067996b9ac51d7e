"""The unmodified tinker client against `twinkled serve` on a tiny Qwen3-MoE (8 experts,
top-2): two expert-parallel CPU ranks (--workers 2 --ep 2), or a tensor-parallel pair
(--tp 2), give what one rank gives (the engine a one-rank daemon's worker runs, here in
this process: a daemon start less); training lowers the loss, sampling uses the adapter,
and the expert-parallel export loads in peft with the same logprobs."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

tinker = pytest.importorskip("tinker")
os.environ.setdefault("TINKER_TELEMETRY", "0")

T = 120
TEXTS = ["the sun and the sea are big.", "hello world from twinkle, yes."]


def _run(daemon, model_dir, export: Path | None = None) -> dict:
    """Four SFT steps, the logprobs after them and a greedy sample; with `export`, the
    adapter exported (save_weights_external) and downloaded there, as a user would."""
    from daemon import make_key

    key = make_key(daemon.data_dir, "alice")
    sc = tinker.ServiceClient(base_url=daemon.url, api_key=key)
    tc = sc.create_lora_training_client(base_model=model_dir.name, rank=8, seed=0).result(timeout=T)
    tok = tc.get_tokenizer()
    data, rows = [], []
    for text in TEXTS:
        ids = tok(text).input_ids
        rows.append((ids[:-1], ids[1:]))
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
    prompt_ids = tok("the sun").input_ids
    prompt = tinker.types.ModelInput.from_ints(prompt_ids)
    greedy = tinker.types.SamplingParams(max_tokens=6, temperature=0.0)
    seq = sampler.sample(prompt, 1, greedy).result(timeout=T).sequences[0]
    # Unseeded draws: an expert group's ranks must draw alike or their layers would mix
    # different tokens (and could stop at different steps and wait on each other forever).
    drawn = sampler.sample(prompt, 3, tinker.types.SamplingParams(max_tokens=8, temperature=1.0)
                           ).result(timeout=T).sequences
    assert len(drawn) == 3 and all(1 <= len(s.tokens) <= 8 for s in drawn)
    if export is not None:
        rest = tinker.RestClient(base_url=daemon.url, api_key=key)
        path = tc.save_weights_external("hf").result(timeout=T).path
        for name, url in rest.get_external_weights_urls(path).result(timeout=T).urls.items():
            with urllib.request.urlopen(url, timeout=60) as r:
                (export / name).write_bytes(r.read())
    return {"losses": losses, "logprobs": logprobs, "tokens": seq.tokens, "lp": seq.logprobs,
            "rows": rows, "prompt": prompt_ids}


def _one_rank(model_dir, rows, prompt: list[int]) -> dict:
    """_run's steps on one whole engine in this process (what a one-rank daemon's worker
    runs for the tinker client: LoRA alpha 32, Tinker's Adam defaults): the four losses,
    the logprobs after them and the greedy sample with its logprobs."""
    import torch
    from helpers import make_engine

    from twinkled.protocol.types import (
        AdamParams,
        Datum,
        ForwardBackwardRequest,
        LoraConfig,
        SampleRequest,
        SamplingParams,
    )

    eng = make_engine(model_dir)
    eng.add_adapter("a", LoraConfig(rank=8, seed=0))
    data = [Datum(torch.tensor(ids), {"target_tokens": torch.tensor(targets),
                                      "weights": torch.ones(len(targets))})
            for ids, targets in rows]
    losses = []
    for _ in range(4):
        losses.append(eng.forward_backward([ForwardBackwardRequest("a", data)])[0]
                      .metrics["loss:sum"])
        eng.optim_step("a", AdamParams(learning_rate=1e-2))
    out = eng.forward([ForwardBackwardRequest("a", data)])[0].outputs
    (sampled,) = eng.sample([SampleRequest("a", prompt, SamplingParams(6, temperature=0.0))])
    seq = sampled.sequences[0]
    return {"losses": losses, "logprobs": [o["logprobs"].tolist() for o in out],
            "tokens": seq.tokens, "lp": seq.logprobs}


def test_moe_training_and_expert_parallel_ranks_match_one(moe_dir, tmp_path):
    from daemon import Daemon

    results = {}
    export = tmp_path / "export"
    export.mkdir()
    for name, extra in (("ep2", ("--workers", "2", "--ep", "2")),
                        ("tp2", ("--devices", "cpu,cpu", "--tp", "2"))):
        data = tmp_path / name
        d = Daemon(moe_dir, data, tmp_path / f"{name}.log", *extra)
        try:
            results[name] = _run(d, moe_dir, export if name == "ep2" else None)
        finally:
            d.stop()
    one = _one_rank(moe_dir, results["ep2"]["rows"], results["ep2"]["prompt"])
    assert one["losses"][-1] < 0.7 * one["losses"][0], one["losses"]
    assert len(one["tokens"]) == 6
    # The experts split over two ranks (--ep 2), or the attention heads and the experts
    # split over a tensor-parallel pair (--tp 2), give what one rank gives.
    for split in (results["ep2"], results["tp2"]):
        assert split["tokens"] == one["tokens"]
        assert split["losses"] == pytest.approx(one["losses"], rel=1e-4)
        for x, y in zip(split["logprobs"], one["logprobs"], strict=True):
            assert x == pytest.approx(y, abs=1e-4)
        assert split["lp"] == pytest.approx(one["lp"], abs=1e-4)

    # peft loads the export (target_parameters on the experts; gathered from the expert
    # ranks) and gives the logprobs the daemon gave.
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    pm = PeftModel.from_pretrained(base, export).eval()
    ep2 = results["ep2"]
    for (ids, targets), want in zip(ep2["rows"], ep2["logprobs"], strict=True):
        with torch.no_grad():
            logp = torch.log_softmax(pm(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        got = logp.gather(1, torch.tensor(targets)[:, None])
        assert got[:, 0].tolist() == pytest.approx(want, abs=1e-4)


def test_ep_that_does_not_divide_the_ranks_is_refused(moe_dir, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "twinkled", "serve", "--model", str(moe_dir), "--data-dir",
         str(tmp_path), "--device", "cpu", "--workers", "2", "--ep", "3"],
        capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "--ep 3 must divide the 2 worker ranks" in out.stderr
