"""Qwen3.5-MoE and Qwen3-Next (qwen35_moe.py: Qwen3.5's hybrid layers, a sparse MLP with a
gated shared expert) against transformers' own models and peft on tiny random checkpoints
written as the real ones are (qwen3_5_moe: nested text_config, a vision tower, experts
saved one by one under model.language_model.*; qwen3_next: text only, fused linear-attention
projections, layer 1 dense)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import (
    all_close,
    assert_export_round_trip,
    assert_packed_logprobs_equal_hf,
    grads,
    hf_logprobs,
    make_engine,
    random_datum,
    randomize_b,
)

from twinkled.engine.moe_peft import from_peft, peft_module, to_peft
from twinkled.engine.running import RunningBatch
from twinkled.engine.sampler import generate
from twinkled.protocol.types import (
    ForwardBackwardRequest,
    LoraConfig,
    SampleRequest,
    SamplingParams,
)

SHARED = "model.layers.0.mlp.shared_expert.gate_proj"
EXPERTS = "model.layers.3.mlp.experts.gate_up_proj"


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_next"])
def q35moe_dir(request, tmp_path_factory):
    from twinkled.engine.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("q35moe") / f"tiny-{request.param}",
                            arch=request.param, num_layers=4, embed_std=0.05)


@pytest.fixture(scope="module")
def eng(q35moe_dir):
    e = make_engine(q35moe_dir)
    e.add_adapter("a", LoraConfig(rank=4, alpha=8, seed=0))
    e.add_adapter("b", LoraConfig(rank=8, seed=1, train_attn=False))  # another bank
    for seed, name in enumerate(("a", "b")):
        randomize_b(e, name, seed=seed + 10, std=0.1)
    return e


@contextlib.contextmanager
def _peft(hf, a):
    """transformers' model under peft with adapter `a`'s weights (its expert pairs as
    peft's target_parameters); as it was afterwards. Yields the model and, per bank key,
    peft's (lora_A, lora_B) parameters."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from twinkled.engine.moe_peft import is_expert, peft_parameters

    keys = list(a.bank.shapes)
    targets = sorted({k.rsplit(".", 1)[-1] for k in keys if not is_expert(k)})
    pm = get_peft_model(hf, PeftLoraConfig(r=a.bank.rank, lora_alpha=a.config.alpha,
                                           target_modules=targets,
                                           target_parameters=peft_parameters(keys)))
    try:
        named = dict(pm.named_parameters())
        params = {}
        for key in keys:
            pa, pb = (named[f"base_model.model.{peft_module(key)}.lora_{x}.default.weight"]
                      for x in "AB")
            pa.data.copy_(to_peft(key, "lora_A", a.bank.A[key][a.slot]))
            pb.data.copy_(to_peft(key, "lora_B", a.bank.B[key][a.slot]))
            params[key] = (pa, pb)
        yield pm, params
    finally:
        pm.unload()


def test_layers_targets_and_logprobs_equal_transformers(eng):
    """Every layer sparse (Qwen3-Next: but its mlp_only_layers), the shared expert's linears
    and the experts targets of train_mlp; our forward = transformers', rows alone and packed
    end to end."""
    m = eng.model
    next_ = m.config.model_type == "qwen3_next"
    assert sorted(m.moe) == ([0, 2, 3] if next_ else [0, 1, 2, 3]) and m.hybrid is not None
    # Qwen3-Next: experts only (peft reads its gate/up/down_proj targets as the experts')
    assert (SHARED in m.targets) != next_ and "model.layers.1.mlp.gate_proj" not in m.targets
    assert not eng.padded_sampling  # the running batch carries the linear-attention state
    assert m.targets[EXPERTS] == (128, 128, 8)
    b = eng.pool.get("b").bank.shapes
    assert EXPERTS in b and not any("linear_attn" in k for k in b)
    assert not any(k.endswith(("mlp.gate", "shared_expert_gate")) for k in m.targets)
    assert_packed_logprobs_equal_hf(m)


def test_two_adapters_cobatched_equal_each_alone_and_peft(eng):
    """Two adapters of two banks co-batched (packed rows) = each alone = peft's autograd
    on transformers' Qwen3.5-MoE, for every linear, expert and shared expert."""
    m = eng.model
    gen = torch.Generator().manual_seed(3)
    data = {n: [random_datum(gen, k, m.vocab_size) for k in ks]
            for n, ks in (("a", (40, 7)), ("b", (21,)))}
    out = eng.forward_backward([ForwardBackwardRequest(n, d) for n, d in data.items()])
    together = {n: grads(eng, n) for n in data}
    for n in data:
        eng.zero_grad(n)
    for i, (n, d) in enumerate(data.items()):
        alone = eng.forward_backward([ForwardBackwardRequest(n, d)])[0]
        assert alone.metrics["loss:sum"] == pytest.approx(out[i].metrics["loss:sum"], rel=1e-5)
        g = grads(eng, n)
        eng.zero_grad(n)
        assert together[n][EXPERTS][0].abs().max() > 0
        # fp32, relative to each gradient's largest (packed and padded rows sum apart)
        assert all_close(together[n], g, rtol=1e-4)

    a = eng.pool.get("a")
    with _peft(m.hf, a) as (pm, params):
        loss = 0
        for d in data["a"]:
            logits = pm(input_ids=torch.as_tensor(d.tokens)[None]).logits[0].float()
            lp = logits.log_softmax(-1).gather(1, d.loss_inputs["target_tokens"][:, None])
            loss = loss - lp.sum()
        assert loss.item() == pytest.approx(out[0].metrics["loss:sum"], rel=1e-5)
        loss.backward()
        for key, (pa, pb) in params.items():
            want = {key: from_peft(key, pa.grad, pb.grad, a.bank.rank, a.bank.shapes[key])}
            assert all_close({key: together["a"][key]}, want, rtol=1e-4, atol=1e-4), key


def test_greedy_and_seeded_samples_equal_transformers_with_the_adapter(eng):
    """The running batch (varlen prefill in chunks of 16, experts' LoRA per piece and per
    decode slot): greedy tokens through adapter "a" are peft's `generate`; seeded samples
    of both adapters co-batched are each one's alone, and every sampled token's logprob is
    peft's on prompt + sample (each step carried its own state and its own experts)."""
    m = eng.model
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, m.vocab_size, (n,), generator=gen).tolist() for n in (7, 40)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, stop=[])
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=7, stop=[])
    reqs = [SampleRequest("a", prompts[0], greedy, num_samples=2),
            SampleRequest("a", prompts[1], seeded, num_samples=2),
            SampleRequest("b", prompts[1], seeded)]
    adapters = [eng.pool.get(r.adapter_id) for r in reqs]
    together = generate(m, reqs, adapters, batch=RunningBatch(m, prefill_tokens=16))
    alone = generate(m, reqs[2:], adapters[2:], batch=RunningBatch(m, prefill_tokens=16))
    assert [s.tokens for s in alone[0].sequences] == [s.tokens for s in together[2].sequences]
    with _peft(m.hf, adapters[0]) as (pm, _):
        p = prompts[0]
        want = pm.generate(input_ids=torch.tensor([p]), max_new_tokens=8, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert [s.tokens for s in together[0].sequences] == [want, want]
        for res, p in ((together[0], prompts[0]), (together[1], prompts[1])):
            for s in res.sequences:
                lp = hf_logprobs(pm, p + s.tokens)[len(p) - 1:]
                assert (torch.tensor(s.logprobs) - lp).abs().max() < 1e-4
    with _peft(m.hf, adapters[2]) as (pm, _):
        s = together[2].sequences[0]
        lp = hf_logprobs(pm, prompts[1] + s.tokens)[len(prompts[1]) - 1:]
        assert (torch.tensor(s.logprobs) - lp).abs().max() < 1e-4


def test_checkpoint_loads_in_peft_and_back(eng, q35moe_dir, tmp_path):
    """An export (experts in peft's target_parameters form) loads in peft on transformers'
    Qwen3.5-MoE with our logits, and loads back."""
    import json

    eng.save("a", tmp_path / "a", optimizer=False)
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert cfg["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    next_ = "next" in str(q35moe_dir)
    mlp = () if next_ else ("gate_proj", "up_proj", "down_proj")  # (the shared expert's)
    linear = ("in_proj_qkvz", "in_proj_ba") if next_ else ("in_proj_qkv",)
    assert {"q_proj", *mlp, *linear} <= set(cfg["target_modules"])
    assert_export_round_trip(eng, q35moe_dir, "a", tmp_path / "a")


def test_tp_and_ep_layouts_are_accepted(q35moe_dir, tmp_path):
    """Tensor parallelism splits the linear-attention heads (tests/test_engine_tp.py runs
    it on Qwen3.5 and Qwen3-Next); expert parallelism the experts
    (tests/test_qwen35_moe_e2e.py runs it)."""
    from twinkled.protocol.config import Config
    from twinkled.server.layout import layout_problems

    cfg = Config(model=q35moe_dir, data_dir=tmp_path, devices=["cpu", "cpu"], tp=2)
    assert layout_problems(cfg) == []
    assert layout_problems(Config(model=q35moe_dir, data_dir=tmp_path, devices=["cpu", "cpu"],
                                  ep=2)) == []


def test_daemon_sizes_the_experts(tmp_path):
    """The start-up checks count every expert (Qwen3.5-35B-A3B's config.json, nested as
    released: no intermediate_size): about 34B parameters, so bf16 fits one H200, not one
    H100 (whose refusal names the need)."""
    import json

    from transformers import Qwen3_5MoeTextConfig

    from twinkled.protocol.config import Config
    from twinkled.protocol.sizing import weight_bytes
    from twinkled.server.layout import layout_problems

    text = Qwen3_5MoeTextConfig().to_dict()  # (its defaults are the 35B-A3B's numbers)
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_5_moe", "text_config": text, "vision_config": {"depth": 27}}))
    cfg = Config(model=tmp_path, data_dir=tmp_path / "data", devices=["cuda:0"])
    assert 33e9 < weight_bytes(cfg.model_config, 1) < 36e9
    assert layout_problems(cfg, gpu_memory=[141 * 10**9]) == []
    assert "needs about" in layout_problems(cfg, gpu_memory=[80 * 10**9])[0]
