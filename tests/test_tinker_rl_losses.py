"""stable_reinforce, gspo and dro through a real `twinkled serve`, driven by the unmodified
tinker 0.38 client the way the tinker-cookbook 0.6.1 RL loop drives them: sampling with
record_stability_info=True, datums with provenance spans, losses checked against their
formulas on the logprobs the server returns; and the SDK's client-side custom loss
(forward_backward_custom, as a DPO recipe uses it)."""

from __future__ import annotations

import os

import pytest
import torch

tinker = pytest.importorskip("tinker")
os.environ.setdefault("TINKER_TELEMETRY", "0")
types = tinker.types

T = 120
REFUSED = (tinker.RequestFailedError, tinker.BadRequestError)


def service(daemon, tenant="alice"):
    return tinker.ServiceClient(base_url=daemon.url, api_key=daemon.keys[tenant])


def sample(tc, tok, record=True, temperature=3.0, n=3):
    """Rollouts from the current weights. T != 1 makes the sampler's logprobs differ from the
    learner's, so the losses see ratios away from 1 on both sides (the tiny random model is
    very peaked: T=3 gives it both near-certain and unlikely tokens)."""
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=record).result(
        timeout=T)
    prompt = types.ModelInput.from_ints(tok("the sun and the").input_ids)
    params = types.SamplingParams(max_tokens=6, temperature=temperature, seed=7, stop=[])
    return prompt, sampler.sample(prompt, n, params).result(timeout=T).sequences


def rl_datum(prompt, seq, advantage, provenance=True, **extra):
    """As tinker-cookbook's rl_loop builds it (recipes/rl_loop.py)."""
    ob = prompt.length - 1
    model_input = prompt.append(types.EncodedTextChunk(tokens=seq.tokens[:-1]))
    inputs = {"target_tokens": [0] * ob + seq.tokens, "logprobs": [0.0] * ob + seq.logprobs,
              "advantages": [0.0] * ob + [advantage] * len(seq.tokens)}
    inputs.update(extra)
    d = types.Datum(model_input=model_input, loss_fn_inputs=inputs)
    if not provenance:
        return d
    sid = seq.sequence_id
    return d.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sid, length=prompt.length),
                     types.SampledProvenanceSpan(sequence_id=sid, length=len(seq.tokens) - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=ob),
                        types.SampledProvenanceSpan(sequence_id=sid, length=len(seq.tokens))])


def stable_reinforce_formula(lp, q, adv, sampled, kl):
    """losses.py's StableReinforce: m * (-sg(min(r, 1)) * A * lp + kl * (r - 1 - log r))."""
    r = torch.where(sampled, torch.exp(lp - q), torch.ones_like(lp))
    loss = -torch.clamp(r, max=1.0) * adv * lp + kl * (r - 1 - torch.log(r))
    return torch.where(sampled, loss, torch.zeros_like(lp))


def test_stable_reinforce_trains_on_recorded_samples(daemon, tiny_dir):
    sc = service(daemon)
    tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=4, seed=1).result(timeout=T)
    tok = tc.get_tokenizer()
    prompt, seqs = sample(tc, tok)
    assert len({s.sequence_id for s in seqs}) == len(seqs) and all(s.sequence_id for s in seqs)
    advantages = [1.0, -0.5, 0.25]
    data = [rl_datum(prompt, s, a) for s, a in zip(seqs, advantages, strict=True)]
    out = tc.forward_backward(data, "stable_reinforce", {"kl_coeff": 0.1}).result(timeout=T)

    total = 0.0
    for o, seq, adv in zip(out.loss_fn_outputs, seqs, advantages, strict=True):
        lp = o["logprobs"].to_torch()
        ob = prompt.length - 1
        sampled = torch.arange(len(lp)) >= ob
        q = torch.tensor([0.0] * ob + seq.logprobs)
        want = stable_reinforce_formula(lp, q, adv * sampled.float(), sampled, 0.1)
        assert o["elementwise_loss"].to_torch().tolist() == pytest.approx(want.tolist(), abs=1e-5)
        r = torch.exp(lp - q)[sampled]
        assert (r < 0.99).any() or (r > 1.01).any()  # off-policy indeed (T=3 sampling)
        total += want.sum().item()
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-4, abs=1e-5)
    assert tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=T)
    # Without kl_coeff the default (0.01) applies.
    out = tc.forward(data, "stable_reinforce").result(timeout=T)
    lp = out.loss_fn_outputs[0]["logprobs"].to_torch()
    ob = prompt.length - 1
    sampled = torch.arange(len(lp)) >= ob
    q = torch.tensor([0.0] * ob + seqs[0].logprobs)
    want = stable_reinforce_formula(lp, q, advantages[0] * sampled.float(), sampled, 0.01)
    assert out.loss_fn_outputs[0]["elementwise_loss"].to_torch().tolist() == pytest.approx(
        want.tolist(), abs=1e-5)
    sc.close("success")


def test_stable_reinforce_refuses_what_it_cannot_trust(daemon, tiny_dir):
    sc = service(daemon)
    tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=4, seed=2).result(timeout=T)
    tok = tc.get_tokenizer()
    prompt, seqs = sample(tc, tok, n=1)
    seq = seqs[0]
    good = rl_datum(prompt, seq, 1.0)

    def variant(model_input=good.model_input, **inputs):
        return types.Datum(model_input=model_input,
                           loss_fn_inputs={**good.loss_fn_inputs, **inputs},
                           model_input_spans=good.model_input_spans,
                           loss_fn_input_spans=good.loss_fn_input_spans)

    ob = prompt.length - 1
    tampered = [0] * ob + seq.tokens[:-1] + [(seq.tokens[-1] + 1) % 100]
    other_prompt = types.ModelInput.from_ints([5] + prompt.to_ints()[1:] + seq.tokens[:-1])
    cases = [
        ([rl_datum(prompt, seq, 1.0, provenance=False)], None,
         r"data\[0\].loss_fn_input_spans: stable_reinforce needs provenance"),
        ([variant(target_tokens=tampered)], None, r"loss_fn_input_spans\[1\]: the tokens it "
         "covers are not sampled tokens"),
        ([variant(model_input=other_prompt)], None, r"model_input_spans\[0\]: the tokens it "
         "covers are not prompt tokens"),
        ([variant(advantages=[0.5] * (ob + len(seq.tokens)))], None,
         r"data\[0\].loss_fn_inputs.advantages: is 0.5 at position 0, which is not a sampled"),
        ([variant(sampler_logprobs=torch.zeros(ob + len(seq.tokens)))], None,
         r"sampler_logprobs: filled in by the server"),
        ([variant()], {"kl_coeff": -1.0}, r"loss_fn_config.kl_coeff: must be >= 0"),
    ]
    for data, config, pattern in cases:
        with pytest.raises(REFUSED, match=pattern):
            tc.forward_backward(data, "stable_reinforce", config).result(timeout=T)
    # Another tenant cannot train on alice's samples: to bob they do not exist.
    bob = service(daemon, "bob").create_lora_training_client(
        base_model=tiny_dir.name, rank=4).result(timeout=T)
    with pytest.raises(REFUSED, match=f"no recorded sequence '{seq.sequence_id}'"):
        bob.forward_backward([variant()], "stable_reinforce").result(timeout=T)
    # Nor can anyone train on a sample that was not recorded.
    _, unrecorded = sample(tc, tok, record=False, n=1)
    with pytest.raises(REFUSED, match="no recorded sequence"):
        tc.forward_backward([rl_datum(prompt, unrecorded[0], 1.0)], "stable_reinforce",
                            ).result(timeout=T)
    # After all that the run is intact and the good datum trains.
    out = tc.forward_backward([variant()], "stable_reinforce").result(timeout=T)
    assert out.metrics["loss:sum"] == out.metrics["loss:sum"]  # finite, not NaN
    sc.close("success")


def test_gspo_and_dro_follow_their_formulas(daemon, tiny_dir):
    sc = service(daemon, "bob")
    tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=4, seed=3).result(timeout=T)
    tok = tc.get_tokenizer()
    prompt, seqs = sample(tc, tok, record=False, n=2)
    ob = prompt.length - 1
    data = [rl_datum(prompt, s, a, provenance=False,
                     sequence_ratio_mask=[0.0] * ob + [1.0] * len(s.tokens))
            for s, a in zip(seqs, [1.0, -1.0], strict=True)]
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    out = tc.forward_backward(data, "gspo", config).result(timeout=T)
    total = 0.0
    for d, o in zip(data, out.loss_fn_outputs, strict=True):
        lp = o["logprobs"].to_torch()
        q, adv = (d.loss_fn_inputs[k].to_torch() for k in ("logprobs", "advantages"))
        m = d.loss_fn_inputs["sequence_ratio_mask"].to_torch() != 0
        s = torch.exp((lp - q)[m].mean())  # Tinker's GSPO page: the geometric mean ratio
        total += (-torch.minimum(s * adv, s.clamp(0.9, 1.1) * adv)).sum().item()
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-4, abs=1e-5)

    plain = [types.Datum(model_input=d.model_input, loss_fn_inputs={
        k: v for k, v in d.loss_fn_inputs.items() if k != "sequence_ratio_mask"}) for d in data]
    out = tc.forward_backward(plain, "dro").result(timeout=T)  # no beta: Tinker's 0.05
    total = 0.0
    for d, o in zip(plain, out.loss_fn_outputs, strict=True):
        lp = o["logprobs"].to_torch()
        q, adv = (d.loss_fn_inputs[k].to_torch() for k in ("logprobs", "advantages"))
        total += (-(lp * adv - 0.5 * 0.05 * (lp - q) ** 2)).sum().item()
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-4, abs=1e-5)
    assert tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=T)

    with pytest.raises(REFUSED, match=r"sequence_ratio_mask: required by 'gspo'"):
        tc.forward_backward(plain, "gspo").result(timeout=T)
    unmarked = [rl_datum(prompt, seqs[0], 1.0, provenance=False,
                         sequence_ratio_mask=[0.0] * (ob + len(seqs[0].tokens)))]
    with pytest.raises(REFUSED, match=r"sequence_ratio_mask: marks no token"):
        tc.forward_backward(unmarked, "gspo").result(timeout=T)
    sc.close("success")


def test_forward_backward_custom_dpo_is_the_cross_entropy_its_gradients_make(daemon, tiny_dir):
    """The SDK's forward_backward_custom (a DPO loss on the client: negative weights for the
    rejected sequence) trains as forward_backward of cross_entropy with those weights does,
    and the preference margin grows."""
    tc = [service(daemon).create_lora_training_client(base_model=tiny_dir.name, rank=4, seed=3)
          .result(timeout=T) for _ in range(2)]

    def datum(ids, weights=None):
        return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={
            "target_tokens": ids[1:], "weights": weights or [1.0] * (len(ids) - 1)})

    chosen, rejected = [5, 6, 7, 8, 9], [5, 6, 7, 10, 11]

    def dpo(data, lps):
        return -torch.nn.functional.logsigmoid(0.5 * (lps[0].sum() - lps[1].sum())), {}

    adam = types.AdamParams(learning_rate=1e-2)
    before = [sum(tc[0].forward([datum(s)], "cross_entropy").result(timeout=T)
                  .loss_fn_outputs[0]["logprobs"].tolist()) for s in (chosen, rejected)]
    tc[0].forward_backward_custom([datum(chosen), datum(rejected)], dpo).result(timeout=T)
    tc[0].optim_step(adam).result(timeout=T)
    # By hand: d loss / d lp_chosen = -0.5 sigmoid(-m), and the opposite for rejected; the
    # server's cross_entropy is sum(-lp * w), so w = -grad.
    m = torch.tensor(0.5 * (before[0] - before[1]))
    w = float(0.5 * torch.sigmoid(-m))
    tc[1].forward_backward([datum(chosen, [w] * 4), datum(rejected, [-w] * 4)],
                           "cross_entropy").result(timeout=T)
    tc[1].optim_step(adam).result(timeout=T)
    after = [[sum(c.forward([datum(s)], "cross_entropy").result(timeout=T)
                  .loss_fn_outputs[0]["logprobs"].tolist()) for s in (chosen, rejected)]
             for c in tc]
    assert after[0] == pytest.approx(after[1], abs=1e-4)
    assert after[0][0] - after[0][1] > before[0] - before[1]
