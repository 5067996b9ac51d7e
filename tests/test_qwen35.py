"""Qwen3.5 dense (hybrid linear attention, qwen35.py): training and sampling against
transformers' own Qwen3.5 on a tiny random checkpoint written as the real one is (nested
text_config, a vision tower, weights under model.language_model.*)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import (
    assert_export_round_trip,
    assert_packed_logprobs_equal_hf,
    grads,
    hf_logprobs,
    random_datum,
    two_adapter_engine,
)

from twinkled.engine.linear_attn import delta_rule, delta_step
from twinkled.engine.running import RunningBatch
from twinkled.engine.sampler import generate
from twinkled.protocol.types import (
    EngineInputError,
    ForwardBackwardRequest,
    SampleRequest,
    SamplingParams,
)


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory):
    from twinkled.engine.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("q35") / "tiny-qwen3_5", arch="qwen3_5",
                            num_layers=4, embed_std=0.05)  # (varied samples)


@pytest.fixture(scope="module")
def eng(qwen35_dir):
    return two_adapter_engine(qwen35_dir)


def test_layers_and_lora_targets(eng):
    m = eng.model
    kinds = [hasattr(layer, "linear_attn") for layer in m.layers]
    assert kinds == [True, True, True, False]  # three linear of every four
    a = eng.pool.get("a")
    assert "model.layers.0.linear_attn.in_proj_qkv" in a.bank.shapes
    assert "model.layers.2.linear_attn.out_proj" in a.bank.shapes
    assert "model.layers.3.self_attn.q_proj" in a.bank.shapes
    with pytest.raises(EngineInputError, match="linear-attention state"):
        m.new_cache(1, 8)
    assert RunningBatch(m).pool.k.shape[0] == 1  # pages for the full-attention layer only
    small = RunningBatch(m, kv_bytes=1 << 20)  # the rows' states take at most half of it
    assert small.rows * small.decode.states.row_bytes(m) <= 1 << 19 < 256 * small.decode.states.row_bytes(m)
    assert not m.hybrid.warm()  # fla's kernels run on CUDA only: nothing to autotune here


def test_logprobs_equal_transformers_single_and_packed(eng):
    """Our forward (no adapter) against Qwen3_5ForCausalLM, rows alone and packed end to
    end: a row's conv and delta-rule state never leak into the next."""
    m = eng.model
    assert_packed_logprobs_equal_hf(m)
    row = torch.randint(0, m.vocab_size, (70,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # a right-padded batch of one row
        one = m.logits(m.forward(row[None], torch.arange(70)[None]))[0]
    got = one.float().log_softmax(-1)[:-1].gather(1, row[1:, None])[:, 0]
    assert (got - hf_logprobs(m.hf, row.tolist())).abs().max() < 1e-4


def test_chunked_delta_rule_equals_the_recurrence():
    """Chunks of 4 over 11 tokens (padded) from a given state = one token at a time."""
    g = torch.Generator().manual_seed(0)
    N, L, H, dk, dv = 2, 11, 3, 8, 5
    q, k = (torch.nn.functional.normalize(torch.randn(N, L, H, dk, generator=g), dim=-1)
            for _ in range(2))
    v = torch.randn(N, L, H, dv, generator=g)
    gate, beta = -torch.rand(N, L, H, generator=g), torch.rand(N, L, H, generator=g)
    s0 = torch.randn(N, H, dk, dv, generator=g)
    o, s = delta_rule(q, k, v, gate, beta, s0, chunk=4)
    state, outs = s0, []
    for t in range(L):
        sl = slice(t, t + 1)
        ot, state = delta_step(q[:, sl], k[:, sl], v[:, sl], gate[:, sl], beta[:, sl], state)
        outs.append(ot)
    assert (o - torch.cat(outs, 1)).abs().max() < 1e-5
    assert (s - state).abs().max() < 1e-5


def test_two_adapters_packed_equal_each_alone_and_peft(eng):
    """Gradients of two adapters co-batched (packed rows) = each alone = peft's autograd on
    transformers' Qwen3.5, for every linear of both layer kinds."""

    m = eng.model
    gen = torch.Generator().manual_seed(3)
    data = {n: [random_datum(gen, k, m.vocab_size) for k in ks]
            for n, ks in (("a", (40, 7)), ("b", (21,)))}
    eng.forward_backward([ForwardBackwardRequest(n, d) for n, d in data.items()])
    together = {n: grads(eng, n) for n in data}
    for n in data:
        eng.zero_grad(n)
    for n, d in data.items():
        eng.forward_backward([ForwardBackwardRequest(n, d)])
        alone = grads(eng, n)
        eng.zero_grad(n)
        for key, (ga, gb) in alone.items():
            assert torch.allclose(together[n][key][0], ga, atol=1e-5), key
            assert torch.allclose(together[n][key][1], gb, atol=1e-5), key

    with _peft(m.hf, eng.pool.get("a")) as (pm, params):
        loss = 0
        for d in data["a"]:
            logits = pm(input_ids=torch.as_tensor(d.tokens)[None]).logits[0].float()
            lp = logits.log_softmax(-1).gather(1, d.loss_inputs["target_tokens"][:, None])
            loss = loss - lp.sum()
        loss.backward()
        for key, (ga, gb) in params.items():
            assert torch.allclose(together["a"][key][0], ga.grad, atol=1e-4), key
            assert torch.allclose(together["a"][key][1], gb.grad, atol=1e-4), key


@contextlib.contextmanager
def _peft(hf, a):
    """transformers' model under peft with adapter `a`'s weights; as it was afterwards."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets = sorted({k.rsplit(".", 1)[-1] for k in a.bank.shapes})
    pm = get_peft_model(hf, PeftLoraConfig(r=a.bank.rank, lora_alpha=a.config.alpha,
                                           target_modules=targets))
    try:
        named = dict(pm.named_parameters())
        params = {}
        for key in a.bank.shapes:
            pa, pb = (named[f"base_model.model.{key}.lora_{x}.default.weight"] for x in "AB")
            pa.data.copy_(a.bank.A[key][a.slot])
            pb.data.copy_(a.bank.B[key][a.slot])
            params[key] = (pa, pb)
        yield pm, params
    finally:
        pm.unload()


def test_greedy_equals_transformers_generate(eng):
    """The running batch (varlen prefill cut in chunks of 16, a 2-sample fan-out copying
    the prompt's state) gives transformers' greedy tokens."""
    m = eng.model
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, m.vocab_size, (n,), generator=gen).tolist() for n in (7, 40)]
    reqs = [SampleRequest(None, p, SamplingParams(max_tokens=8, temperature=0.0, stop=[]),
                          num_samples=1 + i) for i, p in enumerate(prompts)]
    out = generate(m, reqs, [None, None], batch=RunningBatch(m, prefill_tokens=16))
    for p, r in zip(prompts, out, strict=True):
        want = m.hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert [s.tokens for s in r.sequences] == [want] * len(r.sequences)
        lp = hf_logprobs(m.hf, p + want)[len(p) - 1:]
        for s in r.sequences:  # the state each decode step read, to rounding
            assert (torch.tensor(s.logprobs) - lp).abs().max() < 1e-4


def test_seeded_samples_score_as_transformers_with_the_adapter(eng):
    """Seeded samples at temperature 1 through an adapter: every sampled token's logprob
    equals transformers' (adapter merged) on prompt + sample, so each decode step carried
    its own state; the fan-out's samples differ yet both hold; the same seed, the same
    tokens."""
    m = eng.model
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(5, m.vocab_size, (30,), generator=gen).tolist()
    req = SampleRequest("a", prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=7,
                                                    stop=[]), num_samples=3)
    first = eng.sample([req])[0]
    again = eng.sample([req])[0]
    assert [s.tokens for s in again.sequences] == [s.tokens for s in first.sequences]
    assert len({tuple(s.tokens) for s in first.sequences}) > 1
    with _peft(m.hf, eng.pool.get("a")) as (pm, _):
        for s in first.sequences:
            want = hf_logprobs(pm, prompt + s.tokens)[len(prompt) - 1:]
            assert (torch.tensor(s.logprobs) - want).abs().max() < 1e-4


def test_checkpoint_loads_in_peft_and_back(eng, qwen35_dir, tmp_path):
    """An export loads in peft on transformers' Qwen3.5 with our logits, and loads back."""
    eng.save("b", tmp_path / "b", optimizer=False)
    assert_export_round_trip(eng, qwen35_dir, "b", tmp_path / "b")


def test_daemon_sizes_the_nested_config(tmp_path):
    """The daemon's start-up checks read the text model's sizes out of Qwen3.5's nested
    config.json (Qwen3.5-9B's numbers): a 9B fits one H100."""
    import json

    from twinkled.protocol.config import Config
    from twinkled.server.layout import layout_problems

    text = {"model_type": "qwen3_5_text", "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
            "head_dim": 256, "vocab_size": 248320, "max_position_embeddings": 262144}
    text["layer_types"] = ["linear_attention", "linear_attention", "linear_attention",
                           "full_attention"] * 8
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_5", "tie_word_embeddings": False, "text_config": text,
         "vision_config": {"depth": 27}}))
    cfg = Config(model=tmp_path, data_dir=tmp_path / "data", devices=["cuda:0"])
    assert cfg.model_config["vocab_size"] == 248320
    assert layout_problems(cfg, gpu_memory=[80 * 10**9]) == []
    text |= {"linear_num_key_heads": 16, "linear_num_value_heads": 32}
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_5", "tie_word_embeddings": False, "text_config": text,
         "vision_config": {"depth": 27}}))
    cfg = Config(model=tmp_path, data_dir=tmp_path / "data", devices=["cuda:0", "cuda:1"], tp=2)
    assert layout_problems(cfg, gpu_memory=[80 * 10**9] * 2) == []  # (tests/test_engine_tp.py)
    cfg = Config(model=tmp_path, data_dir=tmp_path / "data", devices=["cuda:0"] * 64, tp=64)
    assert ("tp: tp 64 does not divide the model's 16 linear-attention key heads and 32 value "
            "heads") in layout_problems(cfg, gpu_memory=[80 * 10**9] * 64)
