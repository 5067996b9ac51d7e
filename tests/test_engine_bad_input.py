"""Bad input: a clear error naming the field, and every adapter exactly as it was."""

from __future__ import annotations

import pytest
import torch
from helpers import adapter_snapshot, ce_request, randomize_b, rl_datum

from twinkled.protocol.types import (
    Datum,
    EngineInputError,
    ForwardBackwardRequest,
    LoraConfig,
    SampleRequest,
    SamplingParams,
)


@pytest.fixture()
def eng(engine):
    for i, name in enumerate("ab"):
        engine.add_adapter(name, LoraConfig(rank=4, seed=i))
        randomize_b(engine, name, seed=i)
    # Pending gradients and optimizer state exist, so "unchanged" covers them too.
    gen = torch.Generator().manual_seed(0)
    engine.forward_backward([ce_request("a", gen, engine.model.vocab_size, [6])])
    engine.optim_step("a")
    engine.forward_backward([ce_request("a", gen, engine.model.vocab_size, [6]),
                             ce_request("b", gen, engine.model.vocab_size, [6])])
    return engine


def _bad_requests(vocab, max_len):
    gen = torch.Generator().manual_seed(1)
    good = rl_datum(gen, 6, vocab)

    def with_inputs(**changes):
        inputs = dict(good.loss_inputs)
        inputs.update(changes)
        return Datum(good.tokens, {k: v for k, v in inputs.items() if v is not None})

    nan_adv = good.loss_inputs["advantages"].clone()
    nan_adv[2] = float("nan")
    inf_lp = good.loss_inputs["logprobs"].clone()
    inf_lp[0] = float("inf")
    return {
        "token id": (Datum([1, vocab + 5, 2], {"target_tokens": [1, 2, 3]}), "cross_entropy",
                     r"model_input.*token id \d+ is outside"),
        "negative id": (Datum([1, -1, 2], {"target_tokens": [1, 2, 3]}), "cross_entropy",
                        "model_input.*outside the vocabulary"),
        "target id": (Datum([1, 2, 3], {"target_tokens": [1, 2, vocab]}), "cross_entropy",
                      "target_tokens.*outside the vocabulary"),
        "too long": (Datum([1] * (max_len + 1), {"target_tokens": [1] * (max_len + 1)}),
                     "cross_entropy", "model_input: length .* exceeds the model's context"),
        "length mismatch": (with_inputs(advantages=torch.zeros(5)), "ppo",
                            r"advantages: has shape \[5\], but the model input has 6 tokens"),
        "missing input": (with_inputs(logprobs=None), "importance_sampling",
                          "logprobs: required"),
        "unknown loss": (good, "reinforce_plus_plus", "loss_fn: unknown loss 'reinforce_plus_plus'"),
        "nan advantages": (with_inputs(advantages=nan_adv), "ppo", "advantages: contains NaN"),
        "inf logprobs": (with_inputs(logprobs=inf_lp), "cispo", "logprobs: contains NaN"),
        "typo input": (with_inputs(advantage=torch.zeros(6)), "ppo", "advantage: unknown loss input"),
        "float tokens": (Datum([1.5, 2.0], {"target_tokens": [1, 2]}), "cross_entropy",
                         "model_input: token ids must be integers"),
        "empty": (Datum([], {"target_tokens": []}), "cross_entropy", "model_input: is empty"),
        "gspo without mask": (good, "gspo", "sequence_ratio_mask: required by 'gspo'"),
        "gspo empty mask": (with_inputs(sequence_ratio_mask=torch.zeros(6)), "gspo",
                            "sequence_ratio_mask: marks no token"),
        "unrecorded": (good, "stable_reinforce", "sampler_logprobs: required"),
        "advantage on prompt": (with_inputs(sampler_logprobs=torch.zeros(6),
                                            sampled_mask=torch.tensor([0., 0, 1, 1, 1, 1])),
                                "stable_reinforce", "advantages: is .* at position 0, which is "
                                "not a sampled token"),
        "mask not 0/1": (with_inputs(sampler_logprobs=torch.zeros(6),
                                     sampled_mask=torch.full((6,), 0.5)),
                         "stable_reinforce", "sampled_mask: must hold only 0 and 1"),
    }


@pytest.mark.parametrize("case", list(_bad_requests(1024, 2048)))
def test_bad_datum_is_refused_and_changes_nothing(eng, case):
    datum, loss, pattern = _bad_requests(eng.model.vocab_size, eng.model.max_seq_len)[case]
    before = {n: adapter_snapshot(eng, n) for n in "ab"}
    pending = {n: eng.pool.get(n).pending for n in "ab"}
    gen = torch.Generator().manual_seed(2)
    good_other = ce_request("b", gen, eng.model.vocab_size, [5])
    with pytest.raises(EngineInputError, match=pattern):
        # A bad request next to a good one: nothing of either runs.
        eng.forward_backward([good_other, ForwardBackwardRequest("a", [datum], loss)])
    after = {n: adapter_snapshot(eng, n) for n in "ab"}
    for n in "ab":
        assert all(torch.equal(before[n][k], after[n][k]) for k in before[n]), n
        assert eng.pool.get(n).pending == pending[n]


@pytest.mark.parametrize(("loss", "config", "pattern"), [
    ("ppo", {"clip_low_threshold": float("nan")}, "loss_fn_config.clip_low_threshold"),
    ("ppo", {"beta": 0.1}, r"loss_fn_config: \['beta'\] not used by 'ppo'"),
    ("gspo", {"clip_low_threshold": 1.3, "clip_high_threshold": 1.2},
     "loss_fn_config.clip_low_threshold: 1.3 is above clip_high_threshold"),
    ("gspo", {"clip_low_threshold": -0.1}, "loss_fn_config.clip_low_threshold: must be >= 0"),
    ("dro", {"beta": -1.0}, "loss_fn_config.beta: must be >= 0"),
    ("stable_reinforce", {"kl_coeff": -0.01}, "loss_fn_config.kl_coeff: must be >= 0"),
    ("stable_reinforce", {"beta": 0.1}, r"\['beta'\] not used by 'stable_reinforce' "
     r"\(accepted: \['kl_coeff'\]\)"),
])
def test_bad_loss_config(eng, loss, config, pattern):
    gen = torch.Generator().manual_seed(3)
    before = adapter_snapshot(eng, "a")
    with pytest.raises(EngineInputError, match=pattern):
        eng.forward_backward([ForwardBackwardRequest("a", [rl_datum(gen, 4, 1024)], loss, config)])
    after = adapter_snapshot(eng, "a")
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize(("req", "pattern"), [
    (SampleRequest("a", [1, 99999]), "prompt: token id 99999"),
    (SampleRequest("nope", [1, 2]), "adapter_id: no adapter 'nope'"),
    (SampleRequest("a", []), "prompt: is empty"),
    (SampleRequest("a", [1], SamplingParams(max_tokens=0)), "max_tokens: must be >= 1"),
    (SampleRequest("a", [1] * 2000, SamplingParams(max_tokens=100)), "exceeds the model's context"),
    (SampleRequest("a", [1], SamplingParams(temperature=-1)), "temperature"),
    (SampleRequest("a", [1], SamplingParams(top_p=0)), "top_p"),
    (SampleRequest("a", [1], SamplingParams(top_k=0)), "top_k"),
    (SampleRequest("a", [1], SamplingParams(stop=[1, "x"])), "stop: must be all strings"),
    (SampleRequest("a", [1], num_samples=0), "num_samples"),
])
def test_bad_sample_requests(eng, req, pattern):
    with pytest.raises(EngineInputError, match=pattern):
        eng.sample([SampleRequest("b", [1, 2], SamplingParams(max_tokens=2)), req])


def test_non_finite_gradients_never_reach_the_weights(eng):
    """A gradient that overflows (not catchable up front) is dropped by the step, loudly."""
    a = eng.pool.get("a")
    before = adapter_snapshot(eng, "a")
    a.bank.gA["lm_head"][a.slot][0, 0] = float("inf")
    res = eng.optim_step("a")
    assert not res.applied and "non-finite" in res.metrics["reason"]
    after = adapter_snapshot(eng, "a")
    for k in before:
        if k.startswith(("w", "m", "v")):
            assert torch.equal(before[k], after[k])
