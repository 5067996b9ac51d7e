"""gpt-oss (engine/gpt_oss.py, gpt_oss_moe.py, attn_sinks.py, sliding_window.py, mxfp4.py)
against transformers' own GptOssForCausalLM on a tiny random checkpoint of the real config
class (sliding and full attention alternating with a window of 8, sinks, biases, 8 experts
top-4, YaRN): training single and packed, two adapters co-batched = each alone = peft, the
export in peft, sampling = transformers' generate, MXFP4 = transformers' dequantisation."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import grads, hf_logprobs, random_datum, two_adapter_engine
from running_checks import assert_running_batch_equals_padded

from twinkled.engine.moe_peft import from_peft, peft_module
from twinkled.engine.packed import Packing
from twinkled.protocol.types import (
    ForwardBackwardRequest,
    SampleRequest,
    SamplingParams,
)

EXPERT = "model.layers.0.mlp.experts.gate_up_proj"


@pytest.fixture(scope="module")
def oss_dir(tmp_path_factory):
    from twinkled.engine.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("oss") / "tiny-gpt_oss", arch="gpt_oss",
                            num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2,
                            intermediate_size=64, num_experts=8, experts_per_token=4,
                            tie_word_embeddings=False)


@pytest.fixture(scope="module")
def eng(oss_dir):
    return two_adapter_engine(oss_dir)


def test_layers_windows_and_targets(eng):
    m = eng.model
    assert m.sinks.windows == [8, None, 8, None]
    assert sorted(m.moe) == [0, 1, 2, 3]
    assert m.targets[EXPERT] == (64, 128, 8)  # (in, out: gate and up interleaved, experts)
    shapes = eng.pool.get("a").bank.shapes
    assert {"model.layers.1.self_attn.q_proj", "model.layers.3.mlp.experts.down_proj",
            EXPERT} <= set(shapes)
    from twinkled.engine.moe_parallel import ExpertSplit
    from twinkled.engine.sparse import sparse_blocks

    # Expert parallelism: rank 1 of 2 computes experts 4-7, and what it keeps of them is
    # every per-expert tensor, the biases too (test_engine_tp.py runs the split).
    block = sparse_blocks("gpt_oss", m.config, m.layers, ExpertSplit(1, 2, None))[0]
    assert block.owned == slice(4, 8)
    assert [p.shape[0] for p in block.expert_parameters()] == [8] * 4


def test_logprobs_equal_transformers_single_and_packed(eng):
    """Rows longer than the window, alone and packed: each segment's window and sinks."""
    m = eng.model
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, m.vocab_size, (n,), generator=gen).tolist() for n in (30, 5, 19)]
    want = torch.cat([hf_logprobs(m.hf, r) for r in rows])
    pk = Packing.of([len(r) for r in rows], m.device)
    ids = torch.tensor([t for r in rows for t in r])
    with torch.no_grad():
        lp = m.logits(m.forward(ids[None], pk.positions, packing=pk))[0].log_softmax(-1)
        one = m.logits(m.forward(torch.tensor([rows[0]]), torch.arange(30)[None]))[0]
    got = torch.cat([lp[s:s + len(r) - 1].gather(1, torch.tensor(r[1:])[:, None])[:, 0]
                     for s, r in zip((0, 30, 35), rows, strict=True)])
    assert (got - want).abs().max() < 1e-5
    got = one.log_softmax(-1)[:-1].gather(1, torch.tensor(rows[0][1:])[:, None])[:, 0]
    assert (got - hf_logprobs(m.hf, rows[0])).abs().max() < 1e-5


def _peft(oss_dir, eng, name, tmp_path):
    """Our export of `name`, loaded by peft on transformers' gpt-oss."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    eng.save(name, tmp_path / name, optimizer=False)
    cfg = json.loads((tmp_path / name / "adapter_config.json").read_text())
    assert cfg["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    base = AutoModelForCausalLM.from_pretrained(oss_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, tmp_path / name, is_trainable=True)


def test_two_adapters_cobatched_equal_each_alone_and_peft(eng, oss_dir, tmp_path):
    """Losses and gradients of two adapters packed together = each alone = peft's autograd
    on transformers' gpt-oss with our export (attention and every expert)."""
    m = eng.model
    gen = torch.Generator().manual_seed(3)
    data = {n: [random_datum(gen, k, m.vocab_size) for k in ks]
            for n, ks in (("a", (20, 7)), ("b", (13,)))}
    out = eng.forward_backward([ForwardBackwardRequest(n, d) for n, d in data.items()])
    together = {n: grads(eng, n) for n in data}
    for n in data:
        eng.zero_grad(n)
    for i, (n, d) in enumerate(data.items()):
        ref = eng.forward_backward([ForwardBackwardRequest(n, d)])[0]
        assert out[i].metrics["loss:sum"] == pytest.approx(ref.metrics["loss:sum"], rel=1e-5)
        alone = grads(eng, n)
        eng.zero_grad(n)
        for key, (ga, gb) in alone.items():
            assert torch.allclose(together[n][key][0], ga, atol=1e-5), key
            assert torch.allclose(together[n][key][1], gb, atol=1e-5), key
    assert together["a"][EXPERT][1].abs().max() > 0

    pm = _peft(oss_dir, eng, "a", tmp_path)
    loss = 0
    for d in data["a"]:
        logits = pm(input_ids=torch.as_tensor(d.tokens)[None]).logits[0].float()
        lp = logits.log_softmax(-1).gather(1, d.loss_inputs["target_tokens"][:, None])
        loss = loss - lp.sum()
    assert loss.item() == pytest.approx(out[0].metrics["loss:sum"], rel=1e-5)
    loss.backward()
    params = dict(pm.named_parameters())
    for key, shape in eng.pool.get("a").bank.shapes.items():
        name = f"base_model.model.{peft_module(key)}.lora_%s.default.weight"
        ga, gb = from_peft(key, params[name % "A"].grad, params[name % "B"].grad, 4, shape)
        assert torch.allclose(together["a"][key][0], ga, atol=1e-4), key
        assert torch.allclose(together["a"][key][1], gb, atol=1e-4), key


def test_greedy_equals_transformers_generate(eng, oss_dir):
    """The engine's sampler (the running batch: rows of two lengths, a fan-out of 2 sharing
    its prompt's pages; decode well past the window) gives transformers' greedy tokens and
    logprobs."""
    assert not eng.padded_sampling
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(oss_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, eng.model.vocab_size, (n,), generator=gen).tolist()
               for n in (5, 19)]
    reqs = [SampleRequest(None, p, SamplingParams(max_tokens=12, temperature=0.0, stop=[]),
                          num_samples=1 + i) for i, p in enumerate(prompts)]
    out = eng.sample(reqs)
    for p, r in zip(prompts, out, strict=True):
        want = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert [s.tokens for s in r.sequences] == [want] * len(r.sequences)
        lp = hf_logprobs(hf, p + want)[len(p) - 1:]
        for s in r.sequences:
            assert (torch.tensor(s.logprobs) - lp).abs().max() < 1e-4


def test_adapter_samples_equal_peft(eng, oss_dir, tmp_path):
    """Through adapter b (the engine's sampler, rows of two lengths): greedy =
    peft's generate; seeded samples at temperature 1 score as peft scores them."""
    pm = _peft(oss_dir, eng, "b", tmp_path)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(5, eng.model.vocab_size, (n,), generator=gen).tolist()
               for n in (4, 11)]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, stop=[])
    res = eng.sample([SampleRequest("b", p, greedy) for p in prompts])
    with torch.no_grad():
        for p, r in zip(prompts, res, strict=True):
            want = pm.generate(input_ids=torch.tensor([p]), max_new_tokens=10, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            assert r.sequences[0].tokens == want
        seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=7, stop=[])
        s = eng.sample([SampleRequest("b", prompts[1], seeded, num_samples=2)])[0].sequences
        assert s[0].tokens != s[1].tokens
        for seq in s:
            lp = hf_logprobs(pm, prompts[1] + seq.tokens)[len(prompts[1]) - 1:]
            assert (torch.tensor(seq.logprobs) - lp).abs().max() < 1e-4


def test_running_batch_samples_as_the_padded_sampler(eng):
    """Sinks and windows over the KV pages (prefill pieces of 16 past the window of 8, a
    cached prefix, decode through the gathered pages) with each row's expert LoRA: the
    padded sampler's samples."""
    assert_running_batch_equals_padded(eng)


def test_mxfp4_dequantises_as_transformers(oss_dir, eng, tmp_path):
    """A checkpoint with MXFP4 experts (blocks/scales, quantization_config) loads through
    mxfp4.py: every expert weight equals transformers' dequantisation of the same bytes, and
    the model's logprobs those of transformers' model holding them."""
    import shutil

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from twinkled.engine.model import BaseModel
    from twinkled.engine.mxfp4 import dequantize
    from twinkled.engine.tiny_gpt_oss import quantize_experts

    q = tmp_path / "mxfp4"
    shutil.copytree(oss_dir, q)
    quantize_experts(q, eng.model.hf.__class__.from_pretrained(oss_dir, dtype=torch.float32))
    state = load_file(str(q / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 6, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 134, (2, 6, 2), dtype=torch.uint8, generator=g)
    assert torch.equal(dequantize(blocks, scales, torch.float32),
                       convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    m = BaseModel(q)
    ref = AutoModelForCausalLM.from_pretrained(oss_dir, dtype=torch.float32)
    for i, block in m.moe.items():
        for name, ours in (("gate_up_proj", block.gate_up), ("down_proj", block.down)):
            key = f"model.layers.{i}.mlp.experts.{name}"
            want = convert_moe_packed_tensors(state[key + "_blocks"], state[key + "_scales"],
                                              dtype=torch.float32)
            assert torch.equal(ours.transpose(1, 2), want), key
            getattr(ref.model.layers[i].mlp.experts, name).data.copy_(want)
    ids = torch.randint(0, m.vocab_size, (17,), generator=g).tolist()
    with torch.no_grad():
        lp = m.logits(m.forward(torch.tensor([ids]), torch.arange(17)[None]))[0]
    got = lp.log_softmax(-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert (got - hf_logprobs(ref, ids)).abs().max() < 1e-5


def test_prefill_pieces_attend_as_whole_rows():
    """The sampler's packed prefill layout (a piece continuing a cached prefix: queries
    6..19 over keys 0..19; a fresh piece of 7) gives each query what its whole row gives
    it, window and sinks included (the running batch's varlen prefill)."""
    from types import SimpleNamespace

    from twinkled.engine.gpt_oss import SinkAttention

    g = torch.Generator().manual_seed(0)
    att = SinkAttention.__new__(SinkAttention)
    att.windows, att.sinks = [5], [torch.randn(4, generator=g)]
    rows = [[torch.randn(1, h, n, 8, generator=g) for h in (4, 2, 2)] for n in (20, 7)]
    whole = [att.attend(0, q, k, v, 0.3, None, None, None) for q, k, v in rows]
    (qa, ka, va), (qb, kb, vb) = rows
    pieces = SimpleNamespace(starts=[6, 0], q_lens=[14, 7], k_lens=[20, 7])
    out = att.attend(0, torch.cat([qa[:, :, 6:], qb], 2), torch.cat([ka, kb], 2),
                     torch.cat([va, vb], 2), 0.3, None, None, pieces)
    assert torch.allclose(out[:, :14], whole[0][:, 6:], atol=1e-6)
    assert torch.allclose(out[:, 14:], whole[1], atol=1e-6)
    no_window = SinkAttention.__new__(SinkAttention)
    no_window.windows, no_window.sinks = [None], att.sinks
    assert not torch.allclose(no_window.attend(0, qa, ka, va, 0.3, None, None, None), whole[0])


def test_sdpa_sinks_equal_the_eager_formula():
    """The extra-key form through SDPA = the formula op by op (GQA, a window, a query that
    sees no key at all), values and gradients."""
    from twinkled.engine import attn_sinks
    from twinkled.engine.sliding_window import visible

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 9, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 12, 16, generator=g, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, generator=g) * 2
    seen = visible(torch.arange(3, 12), torch.arange(12), 4)[None, None].repeat(2, 1, 1, 1)
    seen[1, :, 0] = False  # (a pad query)
    outs = [f(q, k, v, 0.25, sinks, seen) for f in (attn_sinks.attend, attn_sinks.attend_eager)]
    assert torch.allclose(outs[0], outs[1], atol=1e-6)
    grads_ = [torch.autograd.grad(o.square().sum(), (q, k, v)) for o in outs]
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(*grads_, strict=True))


def test_sparse_blocks_follow_the_model_when_it_moves(oss_dir):
    """The blocks are built before the model goes to its device; on CUDA a view or buffer
    kept from then read the host copy (found on a GPU). A dtype move swaps tensors the same
    way, so it shows the blocks read the module's current tensors on the CPU too."""
    from twinkled.engine.model import BaseModel

    m = BaseModel(oss_dir)
    m.hf.to(torch.float64)
    for block in m.moe.values():
        assert block.gate_up.dtype == block.down.dtype == torch.float64
        assert block.router.dtype == block.gate_up_bias.dtype == torch.float64
