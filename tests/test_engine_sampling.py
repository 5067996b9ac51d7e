"""Sampling: mixed-adapter batches with a KV cache, Tinker's parameters and stop rules."""

from __future__ import annotations

import pytest
import torch
from helpers import ce_request, make_engine, randomize_b

from twinkled.engine.lora import LoraBatch
from twinkled.protocol.types import (
    Datum,
    ForwardBackwardRequest,
    LoraConfig,
    SampleRequest,
    SamplingParams,
)


@pytest.fixture(scope="module")
def eng(tiny_dir):
    e = make_engine(tiny_dir)
    for i, name in enumerate("ab"):
        e.add_adapter(name, LoraConfig(rank=4, alpha=16, seed=i))
        randomize_b(e, name, seed=20 + i, std=0.3)
    return e


def _prompt(eng, n, seed):
    return torch.randint(5, eng.model.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def _greedy_without_cache(eng, adapter_id, prompt, n):
    """Reference: re-run the whole sequence for every new token (no cache, no padding)."""
    adapter = None if adapter_id is None else eng.pool.get(adapter_id)
    seq = list(prompt)
    for _ in range(n):
        dev = eng.model.device
        ids = torch.tensor([seq], device=dev)
        lora = LoraBatch([adapter], eng.model.dtype, dev)
        h = eng.model.forward(ids, torch.arange(len(seq), device=dev)[None], lora)
        seq.append(int(eng.model.logits(h[:, -1:], lora).argmax(-1)))
    return seq[len(prompt):]


def test_greedy_mixed_batch_matches_uncached_reference(eng):
    greedy = SamplingParams(max_tokens=12, temperature=0.0, stop=[])
    reqs = [SampleRequest("a", _prompt(eng, 5, 1), greedy),
            SampleRequest(None, _prompt(eng, 9, 2), greedy),
            SampleRequest("b", _prompt(eng, 3, 3), greedy),
            SampleRequest("a", _prompt(eng, 7, 4), greedy)]
    results = eng.sample(reqs)
    for req, res in zip(reqs, results, strict=True):
        (seq,) = res.sequences
        assert seq.tokens == _greedy_without_cache(eng, req.adapter_id, req.prompt, 12)
        assert seq.stop_reason == "length" and len(seq.logprobs) == 12
    # Adapters change what comes out: the same prompt differs across a, b and base.
    same = [SampleRequest(x, _prompt(eng, 5, 1), greedy) for x in ("a", "b", None)]
    outs = [r.sequences[0].tokens for r in eng.sample(same)]
    assert len({tuple(o) for o in outs}) == 3


def test_sampled_logprobs_match_the_trainer(eng):
    """At temperature 1, a sampled token's logprob equals what forward() computes for it."""
    prompt = _prompt(eng, 6, 5)
    res = eng.sample([SampleRequest("b", prompt, SamplingParams(max_tokens=10, seed=3, stop=[]),
                                    prompt_logprobs=True)])[0]
    seq = res.sequences[0]
    full = prompt + seq.tokens
    fwd = eng.forward([ForwardBackwardRequest("b", [Datum(full[:-1], {"target_tokens": full[1:]})])])
    lps = fwd[0].outputs[0]["logprobs"]
    assert torch.allclose(torch.tensor(seq.logprobs), lps[len(prompt) - 1:], atol=1e-4)
    assert res.prompt_logprobs[0] is None
    assert torch.allclose(torch.tensor(res.prompt_logprobs[1:]), lps[: len(prompt) - 1], atol=1e-4)


def test_the_logprob_gap_of_a_sample_is_zero_in_fp32_and_shows_a_perturbation(eng):
    """Engine.logprob_gap: the sampler's logprobs against the trainer's forward of the same
    tokens (the running figure of /metrics), sampled and greedy, adapter and base model."""
    prompt = _prompt(eng, 6, 7)
    for adapter, temp in (("a", 1.0), (None, 0.0)):
        params = SamplingParams(max_tokens=10, temperature=temp, seed=5, stop=[])
        seq = eng.sample([SampleRequest(adapter, prompt, params)])[0].sequences[0]
        gap = eng.logprob_gap(adapter, prompt, seq.tokens, seq.logprobs)
        assert gap.tokens == 10 and 0 <= gap.mean <= gap.max < 1e-4
        shifted = list(seq.logprobs)
        shifted[3] -= 0.5  # one token off by half a nat: max 0.5, mean 0.05
        off = eng.logprob_gap(adapter, prompt, seq.tokens, shifted)
        assert off.max == pytest.approx(0.5, abs=1e-4)
        assert off.mean == pytest.approx(0.05, abs=1e-4)
    # Scored under another adapter, the same tokens are far off: the adapter is applied.
    assert eng.logprob_gap("b", prompt, seq.tokens, seq.logprobs).mean > 1e-2


def test_the_worker_checks_one_in_n_comparable_samples_while_their_weights_hold(eng):
    """GapChecks (the worker's side of the running figure): the 1st, then every n-th, of
    the requests sampled at temperature 1 or greedy; none at another temperature; none
    whose adapter stepped since it sampled."""
    from twinkled.protocol.types import AdamParams
    from twinkled.workers.gaps import GapChecks

    eng.add_adapter("g", LoraConfig(rank=4, alpha=16, seed=7))
    try:
        checks = GapChecks(eng, every=2)
        hot = SampleRequest("g", _prompt(eng, 5, 8), SamplingParams(max_tokens=4, temperature=0.7))
        warm = SampleRequest("g", _prompt(eng, 5, 9), SamplingParams(max_tokens=4, seed=1))
        for req in (hot, warm, warm, warm, hot):  # comparable: the 1st and 3rd `warm` picked
            checks.sampled(req, eng.sample([req])[0].sequences)
        checks.run()
        gaps = checks.take()
        assert len(gaps) == 2 and all(g.tokens == 4 and g.max < 1e-4 for g in gaps)
        assert checks.take() == []
        checks.sampled(warm, eng.sample([warm])[0].sequences)  # 4th: not picked
        checks.sampled(warm, eng.sample([warm])[0].sequences)  # 5th: picked, then trained
        eng.forward_backward([ce_request("g", torch.Generator().manual_seed(0),
                                         eng.model.vocab_size, [6])])
        eng.optim_step("g", AdamParams(learning_rate=1e-2))
        checks.run()
        assert checks.take() == []  # its weights are gone: not compared with the new ones
    finally:
        eng.remove_adapter("g")


def test_gap_checks_while_samples_decode_take_one_at_a_time_within_their_duty(eng):
    """While the running batch decodes (`decoding`), a check is on the next decode step's
    path: one runs, the next not before the last took DUTY of the time since; with the
    batch idle the rest run at once."""
    from twinkled.workers.gaps import GapChecks

    checks = GapChecks(eng, every=1)
    warm = SampleRequest("a", _prompt(eng, 5, 9), SamplingParams(max_tokens=4, seed=1))
    for _ in range(3):
        checks.sampled(warm, eng.sample([warm])[0].sequences)
    checks.run(decoding=True)
    assert len(checks.take()) == 1 and checks.waiting
    checks.run(decoding=True)  # (at once: the last check's 99x its time has not passed)
    assert checks.take() == [] and checks.waiting
    checks.run()
    assert len(checks.take()) == 2 and not checks.waiting


def test_seed_gives_the_same_output(eng):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, stop=[])
    req = SampleRequest("a", _prompt(eng, 4, 6), params, num_samples=3)
    first = eng.sample([req])[0].sequences
    again = eng.sample([req])[0].sequences
    assert [s.tokens for s in first] == [s.tokens for s in again]
    assert len(first) == 3 and len({tuple(s.tokens) for s in first}) > 1
    # The same seed next to other work in one batch still gives the same output.
    other = SampleRequest("b", _prompt(eng, 11, 7), SamplingParams(max_tokens=5, seed=9))
    mixed = eng.sample([other, req])[1].sequences
    assert [s.tokens for s in mixed] == [s.tokens for s in first]
    diff = SampleRequest("a", req.prompt, SamplingParams(max_tokens=16, seed=4321, stop=[]))
    assert eng.sample([diff])[0].sequences[0].tokens != first[0].tokens


def test_top_k_1_and_tiny_top_p_are_greedy(eng):
    prompt = _prompt(eng, 5, 8)
    greedy = eng.sample([SampleRequest("a", prompt, SamplingParams(max_tokens=8, temperature=0, stop=[]))])
    want = greedy[0].sequences[0].tokens
    for params in (SamplingParams(max_tokens=8, top_k=1, seed=1, stop=[]),
                   SamplingParams(max_tokens=8, top_p=1e-6, seed=2, stop=[])):
        assert eng.sample([SampleRequest("a", prompt, params)])[0].sequences[0].tokens == want


def test_top_k_limits_choices(eng):
    prompt = _prompt(eng, 3, 9)
    lora = LoraBatch([eng.pool.get("a")], eng.model.dtype, eng.model.device)
    with torch.no_grad():
        dev = eng.model.device
        h = eng.model.forward(torch.tensor([prompt], device=dev), torch.arange(3, device=dev)[None], lora)
        top3 = set(eng.model.logits(h[:, -1:], lora)[0, 0].topk(3).indices.tolist())
    params = SamplingParams(max_tokens=1, temperature=5.0, top_k=3, seed=0)
    res = eng.sample([SampleRequest("a", prompt, params, num_samples=40)])[0]
    firsts = {s.tokens[0] for s in res.sequences}
    assert firsts <= top3 and len(firsts) > 1


def test_stop_token_ids_strings_and_eos(eng):
    prompt = _prompt(eng, 5, 10)
    free = eng.sample([SampleRequest("a", prompt, SamplingParams(max_tokens=12, temperature=0, stop=[]))])
    tokens = free[0].sequences[0].tokens
    stop_id = tokens[4]
    res = eng.sample([SampleRequest("a", prompt, SamplingParams(max_tokens=12, temperature=0,
                                                                stop=[stop_id]))])[0].sequences[0]
    assert res.stop_reason == "stop" and res.tokens == tokens[: tokens.index(stop_id) + 1]
    text = eng.tokenizer.decode(tokens[3:5])
    res = eng.sample([SampleRequest("a", prompt, SamplingParams(max_tokens=12, temperature=0,
                                                                stop=[text]))])[0].sequences[0]
    assert res.stop_reason == "stop" and len(res.tokens) <= 5
    assert text in eng.tokenizer.decode(res.tokens)


def test_eos_stops_unless_stops_are_disabled(tiny_dir):
    """Make an adapter that always says EOS, then compare stop=None and stop=[]."""
    eng = make_engine(tiny_dir)
    eng.add_adapter("eos", LoraConfig(rank=2, seed=0))
    eos = eng.tokenizer.eos_token_id
    a = eng.pool.get("eos")
    with torch.no_grad():  # lm_head's LoRA pushes every hidden state towards the EOS logit
        a.bank.A["lm_head"][a.slot].fill_(1.0)
        a.bank.B["lm_head"][a.slot][eos].fill_(100.0)
    # (max_tokens 12 > 8 also exercises the CUDA-graph decode path on a GPU)
    prompt = [5, 6, 7]
    res = eng.sample([SampleRequest("eos", prompt, SamplingParams(max_tokens=6, temperature=0)),
                      SampleRequest("eos", prompt, SamplingParams(max_tokens=6, temperature=0, stop=[]))])
    assert res[0].sequences[0].tokens == [eos] and res[0].sequences[0].stop_reason == "stop"
    assert res[1].sequences[0].tokens == [eos] * 6 and res[1].sequences[0].stop_reason == "length"


def test_different_max_tokens_in_one_batch(eng):
    reqs = [SampleRequest("a", _prompt(eng, 4, 11), SamplingParams(max_tokens=n, temperature=0, stop=[]))
            for n in (1, 7, 3)]
    assert [len(r.sequences[0].tokens) for r in eng.sample(reqs)] == [1, 7, 3]


@torch.no_grad()
def _prompt_dists(eng, adapter_id, prompt):
    """Reference: every prompt row's full log-softmax [n - 1, V], the prompt run alone."""
    adapter = None if adapter_id is None else eng.pool.get(adapter_id)
    dev = eng.model.device
    lora = LoraBatch([adapter], eng.model.dtype, dev)
    h = eng.model.forward(torch.tensor([prompt], device=dev),
                          torch.arange(len(prompt), device=dev)[None], lora)
    return torch.log_softmax(eng.model.logits(h[:, :-1], lora)[0].float(), -1)


def test_prompt_scores_match_the_full_distributions(eng):
    """Prompt logprobs (last n), top-k rows, target ids and alternative draws, in a batch
    with padding and another adapter, equal what the prompt's own distributions say."""
    prompt = _prompt(eng, 9, 7)
    n, vocab = len(prompt), eng.model.vocab_size
    gen = torch.Generator().manual_seed(5)
    target = torch.randint(0, vocab, (n - 1, 3), generator=gen)
    target[::2, 1] = -1  # cells that ask for nothing
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=3, stop=[])
    req = SampleRequest("a", prompt, params, num_samples=2, prompt_logprobs=True,
                        prompt_last_n=4, topk_prompt=5, topk_sample=4,
                        target_prompt=target.tolist(), alt_tokens_k=3)
    other = SampleRequest("b", _prompt(eng, 14, 8), params)  # longer: req is left-padded
    res, plain = eng.sample([req, other])
    ref = _prompt_dists(eng, "a", prompt).cpu()

    assert res.prompt_logprobs[:n - 4] == [None] * (n - 4)
    want = ref[torch.arange(n - 1), torch.tensor(prompt[1:])]
    assert res.prompt_logprobs[n - 4:] == pytest.approx(want[n - 5:].tolist(), abs=1e-4)

    ids, lps = res.topk_prompt
    assert ids[:n - 4] == [[]] * (n - 4) and lps[:n - 4] == [[]] * (n - 4)
    top = ref.topk(5, dim=-1)
    assert ids[n - 4:] == top.indices[n - 5:].tolist()
    assert torch.tensor(lps[n - 4:]) == pytest.approx(top.values[n - 5:], abs=1e-4)

    got = torch.tensor(res.target_prompt)
    expect = ref.gather(1, target.clamp(min=0)).masked_fill(target < 0, 0.0)
    assert got.shape == (n - 1, 3) and got == pytest.approx(expect, abs=1e-4)

    alt_ids, alt_lps = (torch.tensor(x) for x in res.alt_tokens)  # on the CPU, as ref
    assert alt_ids.shape == (n - 1, 3)
    assert alt_lps == pytest.approx(ref.gather(1, alt_ids), abs=1e-4)
    again = eng.sample([req])[0]  # seeded: the same draws (alone: no padding, same values)
    assert again.alt_tokens[0] == res.alt_tokens[0]

    for seq in res.sequences:  # top-k of the distribution each token was drawn from
        rows_ids, rows_lps = seq.topk
        assert len(rows_ids) == len(seq.tokens) and all(len(r) == 4 for r in rows_ids)
        for tok, lp, r_ids, r_lps in zip(seq.tokens, seq.logprobs, rows_ids, rows_lps,
                                         strict=True):
            assert r_lps == sorted(r_lps, reverse=True) and lp <= r_lps[0] + 1e-5
            if tok in r_ids:
                assert r_lps[r_ids.index(tok)] == pytest.approx(lp, abs=1e-5)
    assert plain.prompt_logprobs is None and plain.topk_prompt is None
    assert plain.sequences[0].topk is None


def test_alternative_draws_at_temperature_zero_are_the_argmax(eng):
    prompt = _prompt(eng, 6, 9)
    req = SampleRequest(None, prompt, SamplingParams(max_tokens=1, temperature=0.0),
                        alt_tokens_k=2, topk_prompt=1)
    res = eng.sample([req])[0]
    best = [row[0] for row in res.topk_prompt[0][1:]]
    assert res.alt_tokens[0] == [[b, b] for b in best]


def test_a_shared_prefill_samples_what_prefilling_every_row_samples(eng):
    """num_samples copies and identical prompts across requests prefill once
    (sampler.generate); the samples are those of prefilling every row on its own, for the
    same seeds: tokens equal, logprobs and prompt logprobs to float tolerance."""
    from twinkled.engine.sampler import generate

    p, q = _prompt(eng, 11, 7), _prompt(eng, 4, 8)
    hot = SamplingParams(max_tokens=8, temperature=1.0, seed=5, stop=[])
    reqs = [SampleRequest("a", p, hot, num_samples=4, prompt_logprobs=True),
            SampleRequest("b", p, SamplingParams(max_tokens=8, temperature=0.7, seed=6, stop=[]),
                          num_samples=3),
            SampleRequest("a", p, SamplingParams(max_tokens=8, temperature=0.0, stop=[])),
            SampleRequest(None, q, hot, num_samples=2),
            SampleRequest("a", q, SamplingParams(max_tokens=8, temperature=1.0, seed=9, stop=[]),
                          num_samples=2)]
    adapters = [None if r.adapter_id is None else eng.pool.get(r.adapter_id) for r in reqs]
    shared = generate(eng.model, reqs, adapters)
    alone = generate(eng.model, reqs, adapters, share_prefill=False)
    for s, a in zip(shared, alone, strict=True):
        assert [x.tokens for x in s.sequences] == [x.tokens for x in a.sequences]
        for x, y in zip(s.sequences, a.sequences, strict=True):
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5)
    assert shared[0].prompt_logprobs[1:] == pytest.approx(alone[0].prompt_logprobs[1:],
                                                          abs=1e-5)
    # The copies really are different samples (temperature 1), not one sample repeated.
    assert len({tuple(x.tokens) for x in shared[0].sequences}) > 1


@pytest.mark.parametrize("top_p", [0.6, 0.8, 0.9])  # none on a boundary of the masses
def test_a_middle_top_p_keeps_the_smallest_prefix_reaching_it(top_p):
    """On known logits, the drawn tokens are exactly the reference nucleus (the most likely
    tokens until their mass reaches top_p), in proportion to their renormalised probs."""
    from twinkled.engine.choose import RowChoice

    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]
    nucleus = order[mass_before < top_p]  # the reference filter, written out
    want = torch.zeros_like(probs)
    want[nucleus] = probs[nucleus] / probs[nucleus].sum()

    rows = 4000
    params = [SamplingParams(max_tokens=1, temperature=1.0, top_p=top_p)] * rows
    gen = torch.Generator().manual_seed(0)
    choice = RowChoice.of(params, [(list(range(rows)), gen)], torch.device("cpu"))
    tokens, _, _ = choice.choose(probs.log().repeat(rows, 1))
    freq = torch.bincount(tokens, minlength=len(probs)).float() / rows
    assert set(tokens.tolist()) == set(nucleus.tolist())
    assert (freq - want).abs().max() < 0.03  # 4000 draws: sd of each frequency <= 0.008
