"""Rows longer than the model's config (issue 38): RoPE scaling, applied alike in training
and sampling, equal to transformers' own forward with the same scaling."""

from __future__ import annotations

import pytest
import torch
from helpers import make_engine

from twinkled.engine.tiny import build_tiny_model
from twinkled.protocol.types import (
    Datum,
    EngineInputError,
    ForwardBackwardRequest,
    SampleRequest,
    SamplingParams,
)

POSITIONS = 64  # the tiny model's config: rows of up to 64 tokens
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": POSITIONS}


@pytest.fixture(scope="module")
def short_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("short") / "m",
                            max_position_embeddings=POSITIONS)


@pytest.fixture(scope="module")
def yarn_engine(short_dir):
    return make_engine(short_dir, rope_scaling=YARN)


def _reference(model_dir, ids: torch.Tensor) -> torch.Tensor:
    """transformers' own forward of one row under YaRN: logprobs [S, V] (fp32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config.rope_parameters = {**config.rope_parameters, "rope_type": "yarn", "factor": 4.0,
                              "original_max_position_embeddings": POSITIONS}
    config.max_position_embeddings = 4 * POSITIONS
    hf = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(hf(input_ids=ids[None]).logits[0].float(), -1)


def test_yarn_training_and_sampling_equal_transformers(short_dir, yarn_engine):
    eng = yarn_engine
    assert eng.model.max_seq_len == 4 * POSITIONS  # the row-length limit follows
    gen = torch.Generator().manual_seed(0)
    seq = torch.randint(0, eng.model.vocab_size, (201,), generator=gen)
    ref = _reference(short_dir, seq[:-1])
    # Training's forward: the long row packed with a short one (positions restart per row).
    rows = [Datum(seq[:-1], {"target_tokens": seq[1:]}),
            Datum(seq[:30], {"target_tokens": seq[1:31]})]
    out = eng.forward([ForwardBackwardRequest(None, rows)])[0].outputs
    want = ref.gather(-1, seq[1:, None])[:, 0]
    assert torch.allclose(out[0]["logprobs"], want, atol=1e-4, rtol=0)
    assert torch.allclose(out[1]["logprobs"], want[:30], atol=1e-4, rtol=0)
    # The scaling changes what the model computes past its original positions: the
    # comparison above is not one an unscaled model passes.
    plain = make_engine(short_dir, max_seq_len=POSITIONS)
    unscaled = plain.forward([ForwardBackwardRequest(None, rows[1:])])[0].outputs[0]
    assert (unscaled["logprobs"] - want[:30]).abs().max() > 1e-3

    # Sampling: prefill of a 180-token prompt, then greedy decode past it, scored as the
    # same sequence through transformers.
    prompt = seq[:180].tolist()
    res = eng.sample([SampleRequest(None, prompt, SamplingParams(max_tokens=12, temperature=0.0),
                                    prompt_logprobs=True)])[0]
    drawn = res.sequences[0]
    full = torch.tensor(prompt + drawn.tokens)
    ref = _reference(short_dir, full[:-1]).gather(-1, full[1:, None])[:, 0]
    assert torch.allclose(torch.tensor(drawn.logprobs), ref[179:], atol=1e-4, rtol=0)
    assert torch.allclose(torch.tensor(res.prompt_logprobs[1:]), ref[:179], atol=1e-4, rtol=0)


def test_row_limit_follows_the_scaling(short_dir, yarn_engine):
    plain = make_engine(short_dir)
    long_row = ForwardBackwardRequest(None, [Datum(list(range(100)),
                                                   {"target_tokens": list(range(1, 101))})],
                                      forward_only=True)
    with pytest.raises(EngineInputError, match="exceeds the model's context of 64"):
        plain.check(long_row)
    yarn_engine.check(long_row)  # 100 of 256 positions


def test_max_seq_len_alone_derives_yarn_and_bad_scalings_are_refused(short_dir):
    from transformers import AutoConfig

    from twinkled.engine.long_context import extend_context

    config = AutoConfig.from_pretrained(short_dir)
    assert extend_context(config, None, 4 * POSITIONS) == 4 * POSITIONS
    assert config.rope_parameters["rope_type"] == "yarn"
    assert config.rope_parameters["factor"] == 4.0
    config = AutoConfig.from_pretrained(short_dir)
    assert extend_context(config, None, 32) == 32  # only lowers the bound
    assert config.rope_parameters["rope_type"] == "default"
    for bad, what in (({"type": "dynamic", "factor": 2.0}, "rope_type must be one of"),
                      ({"type": "yarn", "factor": 0.5}, "factor must be a number >= 1")):
        with pytest.raises(EngineInputError, match=what):
            extend_context(AutoConfig.from_pretrained(short_dir), bad)
    with pytest.raises(EngineInputError, match="exceeds the 256 positions"):
        extend_context(AutoConfig.from_pretrained(short_dir), YARN, 1000)


def test_a_sample_longer_than_the_kv_pool_is_refused_at_the_door(tiny_dir):
    """The workers say how long a sequence their KV pool holds (its configured size,
    sample_kv_mb); the door refuses a longer prompt + max_tokens with the numbers, where
    before it went on to a pool grown past what the operator gave sampling."""
    from twinkled.engine.running import RunningBatch
    from twinkled.protocol.checks import check_sample
    from twinkled.protocol.config import Config

    eng = make_engine(tiny_dir, kv_bytes=1 << 20)  # 1 MiB: 64 pages of 16 tokens
    batch = RunningBatch(eng.model, kv_bytes=1 << 20)
    assert eng.kv_tokens == batch.pool.usable * batch.pool.page_size == 1008

    def req(n):
        return SampleRequest(None, [1] * (n - 8), SamplingParams(max_tokens=8))

    assert batch.fits(req(eng.kv_tokens)) and not batch.fits(req(eng.kv_tokens + 1))
    limits = Config().request_limits({"vocab_size": 1000, "max_seq_len": 2048,
                                      "kv_tokens": eng.kv_tokens})
    check_sample([1] * 1000, 8, 1, None, limits)
    with pytest.raises(EngineInputError, match=r"prompt \(1000\) \+ max_tokens \(9\) = 1009 "
                       r"tokens exceed the 1008 tokens the sampler's KV pool holds"):
        check_sample([1] * 1000, 9, 1, None, limits)


def test_long_context_keys_are_checked_before_start(tmp_path, tiny_dir):
    """`twinkled config check` and the start's layout check name what is wrong with the
    keys of this issue: a scaling that would rotate sampling and training differently, a
    cp that does not divide the ranks or is given with --tp."""
    from dataclasses import replace

    from twinkled.protocol.config import Config, check_config
    from twinkled.server.layout import layout_problems

    path = tmp_path / "c.toml"
    path.write_text('cp = 2\nmax_seq_len = 131072\nrope_scaling = {rope_type = "yarn", '
                    'factor = 4.0, original_max_position_embeddings = 32768}\n')
    assert check_config(path) == []
    path.write_text('cp = 0\nrope_scaling = {rope_type = "dynamic", factor = 2.0}\n')
    problems = check_config(path)
    assert problems[0] == "cp: must be positive, got 0"
    assert problems[1].startswith("rope_scaling: must be {} or a table of rope_type (one of "
                                  "yarn, linear, llama3, longrope)")
    cfg = Config(model=tiny_dir, device="cpu", workers=2, cp=2)
    assert layout_problems(cfg) == []
    assert layout_problems(replace(cfg, cp=3)) == [
        "cp: --cp 3 must divide each lane's 2 worker ranks"]
    assert any(p.startswith("cp: --cp composes with data parallelism only")
               for p in layout_problems(replace(cfg, tp=2)))


def test_padded_prefill_cuts_a_long_prompt_while_running_rows_decode(yarn_engine):
    """The padded prefill (the GPUs' default) took a prompt longer than its budget whole,
    in one pass: every running row waited for it, and its mask was prompt x prompt. Now it
    is cut into passes of its own (at most budget^2 / prompt tokens each, until the rest
    fits the budget): the running row
    gets a token at each, and both sample what one unchunked pass gives."""
    from twinkled.engine.running import RunningBatch
    from twinkled.engine.sampler import generate_padded

    eng = yarn_engine
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(5, eng.model.vocab_size, (100,), generator=gen).tolist()
    short = SampleRequest(None, prompt[:5], SamplingParams(max_tokens=80, temperature=0,
                                                           stop=[]))
    long = SampleRequest(None, prompt, SamplingParams(max_tokens=4, temperature=0, stop=[]),
                         prompt_logprobs=True)  # scored over its pieces' hidden states
    batch = RunningBatch(eng.model, rows=4, pages=64, page_size=4, prefill_tokens=16,
                         prefill="padded")
    (t_short,) = batch.admit([short], [None])
    batch.step()
    (t_long,) = batch.admit([long], [None])
    grew = []
    while not grew or batch.prefilling.pending:  # a pass of the long prompt each step
        before = len(batch.live[0].tokens)
        batch.step()
        grew.append(len(batch.live[0].tokens) - before)
    # pieces of 16^2 // 100 = 2 tokens until the last 16 fit one pass: 42 + 1 passes
    assert len(grew) == (100 - 16) // 2 + 1 and set(grew) == {1}
    results = {f.ticket: f.result for f in batch.run()}
    want = generate_padded(eng.model, [short, long], [None, None])
    for got, w in zip([results[t_short], results[t_long]], want, strict=True):
        assert got.sequences[0].tokens == w.sequences[0].tokens
        assert got.sequences[0].logprobs == pytest.approx(w.sequences[0].logprobs, abs=1e-4)
    assert results[t_long].prompt_logprobs[1:] == pytest.approx(want[1].prompt_logprobs[1:],
                                                                 abs=1e-4)
