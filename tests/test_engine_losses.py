"""Losses with Tinker semantics: per-token formulas, sums, outputs, forward-only, custom."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    adapter_snapshot,
    all_close,
    centre_on_model,
    grads,
    make_engine,
    max_diff,
    randomize_b,
    rl_datum,
)

from twinkled.engine.losses import target_logprobs
from twinkled.protocol.types import Datum, ForwardBackwardRequest, LoraConfig


@pytest.fixture()
def eng(tiny_dir):
    e = make_engine(tiny_dir)
    e.add_adapter("a", LoraConfig(rank=4, seed=1))
    randomize_b(e, "a", seed=2)
    return e


def _reference(name, lp, d, cfg):
    """The Tinker docs' per-token formulas, written out independently."""
    inputs = {k: torch.as_tensor(v).to(lp.device) for k, v in d.loss_inputs.items()}
    q, adv = inputs.get("logprobs"), inputs.get("advantages")
    r = torch.exp(lp - q) if q is not None else None
    lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
    if name == "cross_entropy":
        return -lp * inputs.get("weights", torch.ones_like(lp))
    if name == "importance_sampling":
        return -r * adv
    if name == "ppo":
        return -torch.min(r * adv, r.clamp(lo, hi) * adv)
    if name == "cispo":
        return -r.detach().clamp(lo, hi) * lp * adv  # CISPO: no gradient through the weight
    if name == "dro":  # Tinker's DRO page: beta 0.05 unless the config says otherwise
        return -(lp * adv - 0.5 * cfg.get("beta", 0.05) * (lp - q) ** 2)
    raise AssertionError(name)


CASES = [
    ("cross_entropy", {}),
    ("importance_sampling", {}),
    ("ppo", {}),
    ("ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}),
    ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    ("dro", {"beta": 0.3}),
    ("dro", {}),
]


@pytest.mark.parametrize(("name", "cfg"), CASES)
def test_loss_values_and_outputs(eng, name, cfg):
    gen = torch.Generator().manual_seed(3)
    vocab = eng.model.vocab_size
    data = [rl_datum(gen, n, vocab) for n in (7, 12)]
    centre_on_model(eng, "a", data, gen)
    if name == "cross_entropy":  # real-valued weights, negative ones too
        for d in data:
            n = len(d.tokens)
            d.loss_inputs = {"target_tokens": d.loss_inputs["target_tokens"],
                             "weights": torch.linspace(-0.5, 1.5, n)}
    base = eng.forward([ForwardBackwardRequest("a", data)])[0]
    if name in ("ppo", "cispo"):  # both clips reached, or the test could not see one go
        _assert_ratios_cross(data, base.outputs, cfg)
    res = eng.forward_backward([ForwardBackwardRequest("a", data, name, cfg)])[0]
    total = 0.0
    for d, out, fwd in zip(data, res.outputs, base.outputs, strict=True):
        assert torch.allclose(out["logprobs"], fwd["logprobs"], atol=1e-6)
        want = _reference(name, fwd["logprobs"], d, cfg)
        assert torch.allclose(out["elementwise_loss"], want, atol=1e-5)
        total += want.sum().item()
    # Summed over tokens and datums, not averaged.
    assert res.metrics["loss:sum"] == pytest.approx(total, rel=1e-5, abs=1e-5)
    assert all(":" in k for k in res.metrics)
    assert eng.pool.get("a").pending == 2


def _assert_ratios_cross(data, outputs, cfg):
    lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
    r = torch.cat([torch.exp(o["logprobs"].cpu() - d.loss_inputs["logprobs"])
                   for d, o in zip(data, outputs, strict=True)])
    assert (r < lo).any() and (r > hi).any() and ((r > lo) & (r < hi)).any()


@pytest.mark.parametrize("name", ["ppo", "cispo"])
def test_rl_gradients_follow_the_formula(eng, tiny_dir, name):
    """PPO's and CISPO's gradients through our path equal autograd of the formula on the
    logprobs, with ratios below, inside and above the clip range."""
    gen = torch.Generator().manual_seed(4)
    d = rl_datum(gen, 24, eng.model.vocab_size)
    centre_on_model(eng, "a", [d], gen)
    _assert_ratios_cross([d], eng.forward([ForwardBackwardRequest("a", [d])])[0].outputs, {})
    eng.forward_backward([ForwardBackwardRequest("a", [d], name)])
    ppo_grads = grads(eng, "a")

    # Same gradient from a custom loss that spells the formula out on the logprobs.
    other = make_engine(tiny_dir)
    other.add_adapter("a", LoraConfig(rank=4, seed=1))
    randomize_b(other, "a", seed=2)

    def spelled_out(data, lps):
        per_token = _reference(name, lps[0], data[0], {})
        return per_token.sum(), {"custom:sum": 1.0}

    res = other.forward_backward([ForwardBackwardRequest("a", [d], spelled_out)])[0]
    assert res.metrics["custom:sum"] == 1.0
    assert max_diff(ppo_grads, grads(other, "a")) <= 1e-5


def test_rows_of_one_batch_use_different_losses(eng, tiny_dir):
    gen = torch.Generator().manual_seed(5)
    v = eng.model.vocab_size
    reqs = [ForwardBackwardRequest("a", [rl_datum(gen, 8, v)], "importance_sampling"),
            ForwardBackwardRequest("a", [rl_datum(gen, 6, v)], "cispo"),
            ForwardBackwardRequest("a", [rl_datum(gen, 9, v)], "dro", {"beta": 0.1})]
    together = eng.forward_backward(reqs)
    other = make_engine(tiny_dir)
    other.add_adapter("a", LoraConfig(rank=4, seed=1))
    randomize_b(other, "a", seed=2)
    for r in reqs:  # one call per loss: accumulated gradients must match the single pass
        other.forward_backward([r])
    assert all_close(grads(eng, "a"), grads(other, "a"))
    assert together[2].metrics["loss:sum"] != together[1].metrics["loss:sum"]


def test_forward_only_changes_nothing(eng):
    gen = torch.Generator().manual_seed(6)
    before = adapter_snapshot(eng, "a")
    req = ForwardBackwardRequest("a", [rl_datum(gen, 9, eng.model.vocab_size)], "ppo")
    res = eng.forward([req])[0]
    assert res.outputs[0]["logprobs"].shape == (9,)
    assert (res.outputs[0]["logprobs"] <= 0).all()
    after = adapter_snapshot(eng, "a")
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert eng.pool.get("a").pending == 0
    assert not eng.optim_step("a").applied


def test_custom_loss_gets_per_datum_logprobs(eng):
    gen = torch.Generator().manual_seed(7)
    data = [rl_datum(gen, n, eng.model.vocab_size) for n in (4, 6)]
    seen = []

    def mean_lp(data, lps):
        seen.extend(lp.shape[0] for lp in lps)
        assert all(lp.requires_grad for lp in lps)
        loss = -torch.cat(lps).mean()
        return loss, {"tokens:sum": float(sum(len(lp) for lp in lps))}

    res = eng.forward_backward([ForwardBackwardRequest("a", data, mean_lp)])[0]
    assert seen == [4, 6]
    assert res.metrics["tokens:sum"] == 10
    fwd = eng.forward([ForwardBackwardRequest("a", data)])[0]
    want = -torch.cat([o["logprobs"] for o in fwd.outputs]).mean().item()
    assert res.metrics["loss:sum"] == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("chunk_bytes", [64, 4 * 1000 * 7, 2**30])
def test_chunked_logprobs_equal_log_softmax(chunk_bytes):
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(3, 11, 1000, generator=gen, requires_grad=True)
    tgt = torch.randint(0, 1000, (3, 11), generator=gen)
    weights = torch.randn(3, 11, generator=gen)
    ours = target_logprobs(logits, tgt, chunk_bytes=chunk_bytes)
    (ours * weights).sum().backward()
    g_ours = logits.grad.clone()
    logits.grad = None
    ref = torch.log_softmax(logits, -1).gather(2, tgt[..., None]).squeeze(-1)
    (ref * weights).sum().backward()
    assert torch.allclose(ours, ref, atol=1e-5)
    assert torch.allclose(g_ours, logits.grad, atol=1e-6)


def test_datum_without_weights_defaults_to_ones(eng):
    gen = torch.Generator().manual_seed(9)
    seq = torch.randint(0, eng.model.vocab_size, (8,), generator=gen)
    d = Datum(seq[:-1], {"target_tokens": seq[1:]})
    res = eng.forward_backward([ForwardBackwardRequest("a", [d])])[0]
    assert res.metrics["loss:sum"] == pytest.approx(-res.outputs[0]["logprobs"].sum().item(), abs=1e-5)


def test_top_k_cross_entropy_is_the_weighted_sum_of_k_one_target_losses(tiny_dir):
    """cross_entropy over [N, K] targets and weights (top-K distillation) gives [N, K]
    logprobs and the gradient of sum_k w[:, k] * CE(targets[:, k]), in one micro-batch
    with an ordinary row (K = 1) of another adapter."""
    eng = make_engine(tiny_dir)
    for name, seed in (("a", 1), ("b", 5)):
        eng.add_adapter(name, LoraConfig(rank=4, seed=seed))
        randomize_b(eng, name, seed=seed + 1)
    gen = torch.Generator().manual_seed(9)
    vocab, n, k = eng.model.vocab_size, 6, 3
    tokens = torch.randint(0, vocab, (n,), generator=gen)
    targets = torch.randint(0, vocab, (n, k), generator=gen)
    w = torch.rand(n, k, generator=gen)
    top_k = Datum(tokens, {"target_tokens": targets, "weights": w})
    other = ForwardBackwardRequest("b", [rl_datum(gen, 9, vocab)], "importance_sampling")
    (res, _) = eng.forward_backward([ForwardBackwardRequest("a", [top_k]), other])
    joint = grads(eng, "a")
    eng.zero_grad("a")
    singles = [eng.forward_backward([ForwardBackwardRequest("a", [Datum(
        tokens, {"target_tokens": targets[:, j], "weights": w[:, j]})])])[0] for j in range(k)]
    lp = res.outputs[0]["logprobs"]
    assert lp.shape == (n, k) and res.outputs[0]["elementwise_loss"].shape == (n, k)
    for j, s in enumerate(singles):
        assert torch.allclose(lp[:, j], s.outputs[0]["logprobs"], atol=1e-5)
    assert res.metrics["loss:sum"] == pytest.approx(
        sum(s.metrics["loss:sum"] for s in singles), rel=1e-5)
    assert all_close(joint, grads(eng, "a"), rtol=1e-4, atol=1e-6)  # the k passes summed


def test_top_k_targets_are_for_cross_entropy_only(eng):
    from twinkled.engine import EngineInputError

    gen = torch.Generator().manual_seed(2)
    d = rl_datum(gen, 5, eng.model.vocab_size)
    d.loss_inputs["target_tokens"] = torch.zeros((5, 2), dtype=torch.long)
    with pytest.raises(EngineInputError, match="target_tokens"):
        eng.forward_backward([ForwardBackwardRequest("a", [d], "ppo")])
    ce = Datum(d.tokens, {"target_tokens": torch.zeros((5, 2), dtype=torch.long),
                          "weights": torch.ones(5)})
    with pytest.raises(EngineInputError, match="weights"):
        eng.forward_backward([ForwardBackwardRequest("a", [ce])])


# -- gspo and stable_reinforce: values from the documented formulas, gradients in closed form --

def _sequence_data(eng, gen, name):
    """Two datums whose sampler logprobs sit near the learner's (ratios on both sides of 1
    and of the clip range). The first tokens play the prompt: no advantage there."""
    vocab = eng.model.vocab_size
    data = [rl_datum(gen, n, vocab) for n in (7, 12)]
    fwd = eng.forward([ForwardBackwardRequest("a", data)])[0]
    for d, out in zip(data, fwd.outputs, strict=True):
        n, prompt = len(d.tokens), 3
        sampled = (torch.arange(n) >= prompt).float()
        q = out["logprobs"] + torch.randn(n, generator=gen) * 0.3
        adv = torch.randn(n, generator=gen) * sampled
        d.loss_inputs = {"target_tokens": d.loss_inputs["target_tokens"], "advantages": adv,
                         "logprobs": q}
        if name == "gspo":
            d.loss_inputs["sequence_ratio_mask"] = sampled
        else:
            d.loss_inputs.update(sampler_logprobs=q * sampled, sampled_mask=sampled)
    return data, [o["logprobs"] for o in fwd.outputs]


def _formula(name, lp, d, cfg):
    """(per-token loss, d loss / d lp) as Tinker's GSPO page and losses.py's StableReinforce
    definition state them; the gradient is worked out by hand, not by autograd."""
    inp = d.loss_inputs
    adv = inp["advantages"]
    if name == "gspo":
        lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
        m = inp["sequence_ratio_mask"] != 0
        s = torch.exp((lp - inp["logprobs"])[m].sum() / m.sum())  # geometric mean ratio
        unclipped, clipped = s * adv, s.clamp(lo, hi) * adv
        loss = -torch.minimum(unclipped, clipped)
        # Each token's ratio has value s and gradient s * d lp_t: the unclipped branch (or
        # either, inside the range) gives -A_t * s; the clipped branch outside it gives 0.
        live = (unclipped <= clipped) | ((s >= lo) & (s <= hi))
        return loss, torch.where(live, -adv * s, torch.zeros_like(lp))
    k = cfg.get("kl_coeff", 0.01)
    m = inp["sampled_mask"]
    r = torch.exp(lp - inp["sampler_logprobs"]) * m + (1 - m)
    w = torch.clamp(r, max=1.0)
    loss = m * (-w * adv * lp + k * (r - 1 - torch.log(r)))
    return loss, m * (-w * adv + k * (r - 1))


SEQUENCE_CASES = [
    ("gspo", {}),
    ("gspo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.02}),
    ("stable_reinforce", {}),
    ("stable_reinforce", {"kl_coeff": 0.5}),
    ("stable_reinforce", {"kl_coeff": 0.0}),
]


@pytest.mark.parametrize(("name", "cfg"), SEQUENCE_CASES)
def test_sequence_losses_follow_their_formulas(eng, tiny_dir, name, cfg):
    gen = torch.Generator().manual_seed(10)
    data, lps = _sequence_data(eng, gen, name)
    res = eng.forward_backward([ForwardBackwardRequest("a", data, name, cfg)])[0]
    total, surrogate_grads = 0.0, []
    for d, out, lp in zip(data, res.outputs, lps, strict=True):
        want, dlp = _formula(name, lp, d, cfg)
        assert torch.allclose(out["logprobs"], lp, atol=1e-6)
        assert torch.allclose(out["elementwise_loss"], want, atol=1e-5)
        total += want.sum().item()
        surrogate_grads.append(dlp)
    assert res.metrics["loss:sum"] == pytest.approx(total, rel=1e-5, abs=1e-5)

    # The gradient: a linear surrogate sum(lp * dL/dlp) has the same gradient as the loss;
    # run it as a custom loss on a twin engine and compare the adapters' gradients.
    other = make_engine(tiny_dir)
    other.add_adapter("a", LoraConfig(rank=4, seed=1))
    randomize_b(other, "a", seed=2)

    def surrogate(_data, lps):
        return sum((lp * g.to(lp.device)).sum()
                   for lp, g in zip(lps, surrogate_grads, strict=True)), {}

    other.forward_backward([ForwardBackwardRequest("a", data, surrogate)])
    assert all_close(grads(eng, "a"), grads(other, "a"))


def test_gspo_ratio_is_per_datum(eng):
    """Datums sent together get the same loss as each sent alone: one sequence's ratio never
    mixes in another's tokens, however rows are batched."""
    gen = torch.Generator().manual_seed(11)
    data, _ = _sequence_data(eng, gen, "gspo")
    together = eng.forward([ForwardBackwardRequest("a", data, "gspo")])[0].outputs
    for d, out in zip(data, together, strict=True):
        alone = eng.forward([ForwardBackwardRequest("a", [d], "gspo")])[0].outputs[0]
        assert torch.allclose(out["elementwise_loss"], alone["elementwise_loss"], atol=1e-6)


def test_stable_reinforce_on_policy_is_reinforce(eng):
    """Sampler logprobs equal to the learner's: the loss is plain REINFORCE, -A * lp."""
    gen = torch.Generator().manual_seed(12)
    data, lps = _sequence_data(eng, gen, "stable_reinforce")
    for d, lp in zip(data, lps, strict=True):
        d.loss_inputs["sampler_logprobs"] = lp * d.loss_inputs["sampled_mask"]
    res = eng.forward([ForwardBackwardRequest("a", data, "stable_reinforce")])[0]
    for d, out, lp in zip(data, res.outputs, lps, strict=True):
        want = -d.loss_inputs["advantages"] * lp * d.loss_inputs["sampled_mask"]
        assert torch.allclose(out["elementwise_loss"], want, atol=1e-5)
