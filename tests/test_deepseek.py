"""DeepSeek-V3 (MLA, mla.py; grouped-routing MoE with shared experts, deepseek_moe.py)
against transformers' own DeepseekV3ForCausalLM (and peft on it) on a tiny random
checkpoint of the real config class: a dense first layer then MoE layers, q LoRA rank,
interleaved rope, YaRN mscale, a non-zero router correction bias."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import grads, hf_logprobs, random_datum, two_adapter_engine
from running_checks import assert_running_batch_equals_padded

from twinkled.engine.moe_peft import from_peft, peft_module
from twinkled.engine.packed import Packing
from twinkled.engine.sampler import generate_padded
from twinkled.protocol.types import (
    ForwardBackwardRequest,
    SampleRequest,
    SamplingParams,
)


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory):
    from twinkled.engine.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("dsv3") / "tiny-deepseek_v3",
                            arch="deepseek_v3", num_layers=3, num_heads=4, embed_std=0.05,
                            tie_word_embeddings=False)  # (as released)


@pytest.fixture(scope="module")
def eng(ds_dir):
    return two_adapter_engine(ds_dir)


def test_layers_and_lora_targets(eng):
    m = eng.model
    assert sorted(m.moe) == [1, 2]  # first_k_dense_replace = 1
    shapes = eng.pool.get("a").bank.shapes
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        assert f"model.layers.0.self_attn.{name}" in shapes
    assert "model.layers.0.mlp.gate_proj" in shapes
    assert "model.layers.1.mlp.shared_experts.down_proj" in shapes
    assert "model.layers.2.mlp.experts.gate_up_proj" in shapes
    # YaRN's mscale is in the softmax scale (qk_head_dim**-0.5 alone would be 0.177)
    assert m.scaling == pytest.approx(m.hf.model.layers[0].self_attn.scaling)
    assert m.scaling > 1.2 * 32**-0.5


def test_logprobs_equal_transformers_single_and_packed(eng):
    m = eng.model
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, m.vocab_size, (n,), generator=gen).tolist() for n in (40, 9, 23)]
    want = torch.cat([hf_logprobs(m.hf, r) for r in rows])
    pk = Packing.of([len(r) for r in rows], m.device)
    ids = torch.tensor([t for r in rows for t in r])
    with torch.no_grad():
        lp = m.logits(m.forward(ids[None], pk.positions, packing=pk))[0].float().log_softmax(-1)
    got = torch.cat([lp[s:s + len(r) - 1].gather(1, torch.tensor(r[1:])[:, None])[:, 0]
                     for s, r in zip((0, 40, 49), rows, strict=True)])
    assert (got - want).abs().max() < 1e-4


def test_two_adapters_packed_equal_each_alone(eng):
    m = eng.model
    gen = torch.Generator().manual_seed(3)
    data = {n: [random_datum(gen, k, m.vocab_size) for k in ks]
            for n, ks in (("a", (30, 7)), ("b", (21,)))}
    out = eng.forward_backward([ForwardBackwardRequest(n, d) for n, d in data.items()])
    together = {n: grads(eng, n) for n in data}
    for n in data:
        eng.zero_grad(n)
    for i, (n, d) in enumerate(data.items()):
        alone_out = eng.forward_backward([ForwardBackwardRequest(n, d)])
        for got, want in zip(alone_out[0].outputs, out[i].outputs, strict=True):
            assert torch.allclose(got["logprobs"], want["logprobs"], atol=1e-5)
        alone = grads(eng, n)
        eng.zero_grad(n)
        for key, (ga, gb) in alone.items():
            assert torch.allclose(together[n][key][0], ga, atol=1e-5), key
            assert torch.allclose(together[n][key][1], gb, atol=1e-5), key


def _no_v4_conversion(monkeypatch):
    """peft (0.19) rewrites gate_proj/up_proj/down_proj targets of a model whose transformers
    conversion is qwen2_moe's (DeepSeek-V3's is) as transformers 4's expert names, dropping
    the dense MLPs' and shared experts' LoRA: an adapter made on transformers 5 needs none
    of it, so it is off here (peft's own, not ours)."""
    import peft.utils.transformers_weight_conversion as conv

    monkeypatch.setattr(conv, "convert_peft_config_for_transformers", lambda *a, **k: None)


def test_checkpoint_loads_in_peft_same_logits_and_gradients(eng, ds_dir, tmp_path,
                                                            monkeypatch):
    """The export loads in peft on transformers' DeepSeek-V3 (MLA linears, shared experts
    as target_modules; routed experts as target_parameters): our logits, and peft's
    autograd gives our gradients for every adapted weight."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _no_v4_conversion(monkeypatch)
    eng.save("a", tmp_path / "a", optimizer=False)
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert "kv_b_proj" in cfg["target_modules"]
    base = AutoModelForCausalLM.from_pretrained(ds_dir, dtype=torch.float32)
    pm = PeftModel.from_pretrained(base, tmp_path / "a", is_trainable=True)
    d = random_datum(torch.Generator().manual_seed(4), 24, eng.model.vocab_size)
    ids = torch.as_tensor(d.tokens)[None]
    logits = pm(input_ids=ids).logits
    from twinkled.engine.lora import LoraBatch

    m = eng.model
    with torch.no_grad():
        lora = LoraBatch([eng.pool.get("a")], m.dtype, m.device)
        ours = m.logits(m.forward(ids, torch.arange(24)[None], lora), lora)
        assert (ours - m.logits(m.forward(ids, torch.arange(24)[None]))).abs().max() > 1e-2
    assert (ours - logits.detach()).abs().max() < 1e-4
    lp = logits[0].float().log_softmax(-1).gather(1, d.loss_inputs["target_tokens"][:, None])
    (-lp.sum()).backward()
    eng.zero_grad("a")
    eng.forward_backward([ForwardBackwardRequest("a", [d])])
    mine = grads(eng, "a")
    eng.zero_grad("a")
    params = dict(pm.named_parameters())
    shapes = eng.pool.get("a").bank.shapes
    for key, shape in eng.model.targets.items():
        if key not in shapes:
            continue
        name = f"base_model.model.{peft_module(key)}.lora_%s.default.weight"
        ga, gb = from_peft(key, params[name % "A"].grad, params[name % "B"].grad, 4, shape)
        assert torch.allclose(mine[key][0], ga, atol=1e-4), key
        assert torch.allclose(mine[key][1], gb, atol=1e-4), key


def test_greedy_equals_transformers_generate(eng):
    """The engine's sampler (the running batch, its pages holding the latent) and the padded
    sampler over its latent cache (each step expands it through kv_b_proj), a 2-sample
    fan-out sharing its prompt's prefill, give transformers' greedy tokens."""
    m = eng.model
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, m.vocab_size, (n,), generator=gen).tolist() for n in (7, 30)]
    reqs = [SampleRequest(None, p, SamplingParams(max_tokens=6, temperature=0.0, stop=[]),
                          num_samples=1 + i) for i, p in enumerate(prompts)]
    wants = [m.hf.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
             for p in prompts]
    assert not eng.padded_sampling
    c = m.new_cache(2, 8)  # the latent (kv_lora_rank + qk_rope_head_dim), one "head"
    assert c.k.shape[2:] == (1, 8, 32 + 8) and c.v.numel() == 0
    for out in (generate_padded(m, reqs, [None, None]), eng.sample(reqs)):
        for want, r in zip(wants, out, strict=True):
            assert [s.tokens for s in r.sequences] == [want] * len(r.sequences)


def test_decode_attention_in_blocks_equals_one_call(eng, monkeypatch):
    """The latent decode attention split into blocks of rows and heads (as a wide batch of
    a long context is on the real model) samples what one call over everything samples."""
    from twinkled.engine import mla

    m = eng.model
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, m.vocab_size, (n,), generator=gen).tolist() for n in (9, 21)]
    reqs = [SampleRequest(None, p, SamplingParams(max_tokens=5, temperature=0.0, stop=[]),
                          num_samples=2) for p in prompts]
    whole = generate_padded(m, reqs, [None, None])
    # one row and one head of one row's keys a call
    monkeypatch.setattr(mla, "SDPA_ELEMENTS", 40 * (m.latent.nope + m.latent.rope))
    blocks = generate_padded(m, reqs, [None, None])
    for a, b in zip(whole, blocks, strict=True):
        for x, y in zip(a.sequences, b.sequences, strict=True):
            assert x.tokens == y.tokens
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)


def test_running_batch_samples_as_the_padded_sampler(eng):
    """The running batch's pages hold the latent (one "head" of kv_lora_rank +
    qk_rope_head_dim, no values), both prefills expand it per head, and with each row's
    expert LoRA it samples as the padded sampler does."""
    from twinkled.engine.running import RunningBatch

    pool = RunningBatch(eng.model, rows=2, pages=4).pool
    assert pool.k.shape[2:] == (1, 32 + 8) and pool.v.numel() == 0
    assert_running_batch_equals_padded(eng)


def test_seeded_samples_score_as_peft_with_the_adapter(eng, ds_dir, tmp_path, monkeypatch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _no_v4_conversion(monkeypatch)
    m = eng.model
    prompt = torch.randint(5, m.vocab_size, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    req = SampleRequest("b", prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=7,
                                                    stop=[]), num_samples=2)
    first = eng.sample([req])[0]
    assert [s.tokens for s in eng.sample([req])[0].sequences] == [s.tokens for s in first.sequences]
    eng.save("b", tmp_path / "b", optimizer=False)
    base = AutoModelForCausalLM.from_pretrained(ds_dir, dtype=torch.float32)
    pm = PeftModel.from_pretrained(base, tmp_path / "b").merge_and_unload()
    for s in first.sequences:
        want = hf_logprobs(pm, prompt + s.tokens)[len(prompt) - 1:]
        assert (torch.tensor(s.logprobs) - want).abs().max() < 1e-4


def test_tp_splits_that_do_not_divide_are_refused_with_the_numbers(ds_dir):
    """--tp splits MLA by heads and the experts over the group (test_engine_tp.py runs it);
    a size that divides neither is refused before anything loads, naming what."""
    from twinkled.protocol.sizing import split_problem

    cfg = json.loads((ds_dir / "config.json").read_text())
    assert split_problem(cfg, 2) is None
    assert split_problem(dict(cfg, n_routed_experts=6), 4) == (
        "tp 4 does not divide the model's 6 experts")
    assert split_problem(dict(cfg, moe_intermediate_size=30), 4) == (
        "tp 4 does not divide the width 30 of the model's shared experts")


def test_kimi_k2_config_loads_as_deepseek_v3(ds_dir, tmp_path):
    """Kimi-K2's checkpoint names its type kimi_k2 (remote code): read as DeepSeek-V3."""
    from twinkled.engine.mla import kimi_config

    raw = json.loads((ds_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(
        dict(raw, model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.X"})))
    c = kimi_config(tmp_path)
    assert c.model_type == "deepseek_v3" and c.kv_lora_rank == raw["kv_lora_rank"]
    assert kimi_config(ds_dir) is None


def test_kimi_k2_checkpoint_with_q_proj_and_halves_rope(ds_dir, tmp_path):
    """A checkpoint whose config says kimi_k2 loads as DeepSeek-V3; with q_proj (q_lora_rank
    null), the Llama family's halves rope and no YaRN, our logits equal transformers'."""
    import shutil

    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from twinkled.engine.model import BaseModel

    raw = json.loads((ds_dir / "config.json").read_text())
    raw.update(q_lora_rank=None, rope_interleave=False,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(5)
    hf = DeepseekV3ForCausalLM(DeepseekV3Config(
        **{k: v for k, v in raw.items() if k != "model_type"})).eval()
    with torch.no_grad():
        hf.model.embed_tokens.weight.normal_(0.0, 0.3)
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.3)
    hf.save_pretrained(tmp_path)
    for f in ds_dir.glob("tokenizer*"):
        shutil.copy(f, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, model_type="kimi_k2")))
    m = BaseModel(tmp_path)
    assert "model.layers.0.self_attn.q_proj" in m.targets
    assert "model.layers.0.self_attn.q_a_proj" not in m.targets
    ids = torch.randint(0, m.vocab_size, (2, 17), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        got = m.logits(m.forward(ids, torch.arange(17)[None].expand(2, -1)))
        want = hf(input_ids=ids).logits
    assert (got - want).abs().max() < 1e-4 * max(1.0, want.abs().max().item())


def test_router_bias_follows_the_model_when_it_moves(ds_dir):
    """e_score_correction_bias is a buffer: moving the model (to CUDA, after the blocks are
    built) replaces it, and a block that kept the old one routed with a host tensor (found on
    a GPU). A dtype move replaces buffers the same way."""
    from twinkled.engine.model import BaseModel

    m = BaseModel(ds_dir)
    m.hf.to(torch.float64)
    x = torch.randn(5, m.hf.config.hidden_size, dtype=torch.float64)
    for block in m.moe.values():
        block.gate.e_score_correction_bias.fill_(1e4)  # the last expert group wins everything
        block.gate.e_score_correction_bias[-1] = 2e4
        experts, _ = block.route(x)
        assert (experts == block.n_experts - 1).any(dim=-1).all()
