"""Qwen3.5-MoE through the unmodified tinker client against a real `twinkled serve`, served
under its Tinker name (--model-name Qwen/Qwen3.5-35B-A3B) on two expert-parallel CPU ranks
(--workers 2 --ep 2: each holds half of every layer's experts): two tenants co-batched give
what one of them gives alone (losses, logprobs, gradients: their norm and the step they
make) and what peft gives on transformers' own Qwen3.5-MoE, as one rank does
(tests/test_qwen35_moe.py); samples are peft's."""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path

import pytest
import torch

tinker = pytest.importorskip("tinker")
os.environ.setdefault("TINKER_TELEMETRY", "0")

T = 120
NAME = "Qwen/Qwen3.5-35B-A3B"
# eps far above every gradient: Adam's first step is then -lr * g / (|g| + eps), smooth in g,
# so the weights it makes show the gradients themselves (not only their signs).
ADAM = dict(learning_rate=100.0, eps=1e3)


@pytest.fixture(scope="module")
def q35moe_daemon(tmp_path_factory):
    from daemon import Daemon, make_key

    from twinkled.engine.tiny import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("q35moe_m") / "tiny-qwen3_5_moe",
                             arch="qwen3_5_moe", num_layers=4, embed_std=0.05)
    data = tmp_path_factory.mktemp("q35moe_d")
    d = Daemon(model, data, data / "twinkled.log", "--model-name", NAME, "--workers", "2",
               "--ep", "2")
    d.keys = {t: make_key(data, t) for t in ("alice", "bob", "carol")}
    d.model = model
    yield d
    d.stop()


def _datum(ids: list[int]):
    return tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
                              loss_fn_inputs={"target_tokens": ids[1:],
                                              "weights": [1.0] * (len(ids) - 1)})


def _export(d, tenant: str, tc, into: Path) -> dict[str, torch.Tensor]:
    """The adapter as a user downloads it (save_weights_external), its tensors."""
    from safetensors.torch import load_file

    rest = tinker.RestClient(base_url=d.url, api_key=d.keys[tenant])
    path = tc.save_weights_external("hf").result(timeout=T).path
    into.mkdir()
    for name, url in rest.get_external_weights_urls(path).result(timeout=T).urls.items():
        with urllib.request.urlopen(url, timeout=60) as r:
            (into / name).write_bytes(r.read())
    return load_file(into / "adapter_model.safetensors")


def _peft_logprobs(pm, ids: list[int]) -> torch.Tensor:
    logits = pm(input_ids=torch.tensor([ids[:-1]])).logits[0].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_two_tenants_cobatched_equal_alone_and_peft(q35moe_daemon, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    d = q35moe_daemon
    tc = {}
    for tenant, seed in (("alice", 1), ("bob", 2), ("carol", 1)):  # carol: alice's twin
        sc = tinker.ServiceClient(base_url=d.url, api_key=d.keys[tenant])
        tc[tenant] = sc.create_lora_training_client(base_model=NAME, rank=4,
                                                    seed=seed).result(timeout=T)
    gen = torch.Generator().manual_seed(0)
    rows = {t: [torch.randint(5, 1000, (n,), generator=gen).tolist() for n in ns]
            for t, ns in (("alice", (23, 9)), ("bob", (17,)))}
    rows["carol"] = rows["alice"]
    w0 = _export(d, "carol", tc["carol"], tmp_path / "w0")  # alice's start, too
    adam = tinker.types.AdamParams(**ADAM)
    out = {}
    for group in (("alice", "bob"), ("carol",)):  # co-batched (in flight together), alone
        fb = {t: tc[t].forward_backward([_datum(r) for r in rows[t]], "cross_entropy")
              for t in group}
        fb = {t: f.result(timeout=T) for t, f in fb.items()}
        steps = {t: tc[t].optim_step(adam) for t in group}
        for t in group:
            out[t] = (fb[t].metrics["loss:sum"], [o["logprobs"].tolist() for o in
                                                   fb[t].loss_fn_outputs],
                      steps[t].result(timeout=T).metrics["grad_norm:mean"])
    (loss, lps, norm), (loss_c, lps_c, norm_c) = out["alice"], out["carol"]
    assert loss == pytest.approx(loss_c, rel=1e-5) and norm == pytest.approx(norm_c, rel=1e-4)
    for x, y in zip(lps, lps_c, strict=True):
        assert x == pytest.approx(y, abs=1e-4)
    w1 = _export(d, "alice", tc["alice"], tmp_path / "w1")
    w1c = _export(d, "carol", tc["carol"], tmp_path / "w1c")
    assert w0.keys() == w1.keys() and any("experts" in k for k in w0)
    assert any("shared_expert.gate_proj" in k for k in w0)

    # peft on transformers' Qwen3.5-MoE from the same start: the loss, its logprobs, the
    # gradient's norm and the step Adam takes with it.
    base = AutoModelForCausalLM.from_pretrained(d.model, dtype=torch.float32)
    pm = PeftModel.from_pretrained(base, tmp_path / "w0", is_trainable=True)
    want = [_peft_logprobs(pm, r) for r in rows["alice"]]
    total = -sum(w.sum() for w in want)
    assert total.item() == pytest.approx(loss, rel=1e-5)
    for x, y in zip(lps, want, strict=True):
        assert x == pytest.approx(y.tolist(), abs=1e-4)
    total.backward()
    params = {n: p for n, p in pm.named_parameters() if p.requires_grad}
    grad = {k: params[k.replace(".weight", ".default.weight")].grad for k in w0}
    assert torch.cat([g.flatten() for g in grad.values()]).norm().item() == pytest.approx(
        norm, rel=1e-4)
    for k, g in grad.items():
        step = -ADAM["learning_rate"] * g / (g.abs() + ADAM["eps"])
        scale = step.abs().max().item() + 1e-6
        assert (w1[k] - w0[k] - step).abs().max() <= 1e-4 * scale, k
        assert (w1c[k] - w1[k]).abs().max() <= 1e-5 * scale, k

    # Sampling from the trained adapter: greedy = peft's generate; seeded samples score as
    # peft scores them (every decode step through its adapter's experts and state).
    pm = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(d.model, dtype=torch.float32),
                                   tmp_path / "w1").eval()
    sampler = tc["alice"].save_weights_and_get_sampling_client().result(timeout=T)
    prompt = rows["bob"][0][:6]
    greedy = sampler.sample(tinker.types.ModelInput.from_ints(prompt), 1,
                            tinker.types.SamplingParams(max_tokens=6, temperature=0.0)
                            ).result(timeout=T).sequences[0]
    with torch.no_grad():
        hf = pm.generate(input_ids=torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                         eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert list(greedy.tokens) == hf[:len(greedy.tokens)]
        drawn = sampler.sample(tinker.types.ModelInput.from_ints(prompt), 2,
                               tinker.types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)
                               ).result(timeout=T).sequences
        for s in drawn:
            lp = _peft_logprobs(pm, prompt + list(s.tokens))[len(prompt) - 1:]
            assert s.logprobs == pytest.approx(lp.tolist(), abs=1e-4)
