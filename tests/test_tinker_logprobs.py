"""Distillation inputs through the unmodified tinker client: what a sampling request can
ask about its prompt (logprobs of the last n tokens, top-k rows, chosen ids, alternative
draws), top-k per sampled token, and cross_entropy over [N, K] targets."""

from __future__ import annotations

import math
import os

import pytest

tinker = pytest.importorskip("tinker")
torch = pytest.importorskip("torch")
os.environ.setdefault("TINKER_TELEMETRY", "0")

from test_tinker_e2e import T, service, trained_client  # noqa: E402

TEXT = "the sun and the sea are big and blue today."


@pytest.fixture(scope="module")
def setup(daemon, tiny_dir):
    sc = service(daemon)
    tc, tok, _, _ = trained_client(sc, tiny_dir, steps=1)
    path = tc.save_weights_for_sampler("distill").result(timeout=T).path
    sampler = sc.create_sampling_client(model_path=path)
    ids = tok(TEXT).input_ids
    return tc, sampler, ids


def _forward_logprobs(tc, ids, targets):
    """The trainer's logprob of targets[i] (a list per position) at position i + 1."""
    datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": targets})
    out = tc.forward([datum], "cross_entropy").result(timeout=T)
    return out.loss_fn_outputs[0]["logprobs"].to_torch()


def test_prompt_logprobs_last_n_and_top_k_rows(setup):
    tc, sampler, ids = setup
    n, last = len(ids), 4
    prompt = tinker.types.ModelInput.from_ints(ids)
    res = sampler.sample(prompt, 1, tinker.types.SamplingParams(max_tokens=1),
                         include_prompt_logprobs=True, prompt_logprobs_last_n=last,
                         topk_prompt_logprobs=3).result(timeout=T)
    assert res.prompt_logprobs[:n - last] == [None] * (n - last)
    want = _forward_logprobs(tc, ids, ids[1:])
    assert res.prompt_logprobs[n - last:] == pytest.approx(want[-last:].tolist(), abs=1e-4)
    rows = res.topk_prompt_logprobs
    assert len(rows) == n and rows[:n - last] == [None] * (n - last)
    # Each top-k row, scored by the trainer, gives the same logprobs, in falling order.
    top_ids = torch.tensor([[t for t, _ in row] for row in rows[n - last:]])
    full = torch.full((n - 1, 3), 0, dtype=torch.long)
    full[-last:] = top_ids
    scored = _forward_logprobs(tc, ids, full.tolist())[-last:]
    served = torch.tensor([[lp for _, lp in row] for row in rows[n - last:]])
    assert served == pytest.approx(scored, abs=1e-4)
    assert (served[:, :-1] >= served[:, 1:]).all()
    for row, actual in zip(rows[n - last:], res.prompt_logprobs[n - last:], strict=True):
        assert actual <= row[0][1] + 1e-5  # nothing beats the top-1


def test_target_prompt_logprobs_dense_and_sparse(setup):
    tc, sampler, ids = setup
    n = len(ids)
    wanted = torch.full((n - 1, 2), -1, dtype=torch.long)
    wanted[:, 0] = torch.tensor(ids[1:])
    wanted[-1, 1] = 7
    prompt = tinker.types.ModelInput.from_ints(ids)
    params = tinker.types.SamplingParams(max_tokens=1)
    dense = sampler.sample(prompt, 1, params, target_prompt_logprobs=tinker.types.TensorData
                           .from_torch(wanted)).result(timeout=T).target_prompt_logprobs
    got = dense.to_torch()
    assert list(got.shape) == [n - 1, 2]
    assert got[:, 0] == pytest.approx(_forward_logprobs(tc, ids, ids[1:]), abs=1e-4)
    assert (got[:-1, 1] == 0).all() and got[-1, 1] < 0  # 0.0 where nothing was asked
    sparse_in = tinker.types.TensorData.from_torch_sparse(wanted, pad_value=-1)
    sparse = sampler.sample(prompt, 1, params, target_prompt_logprobs=sparse_in
                            ).result(timeout=T).target_prompt_logprobs
    assert sparse.sparse_crow_indices == sparse_in.sparse_crow_indices
    assert sparse.sparse_col_indices == sparse_in.sparse_col_indices
    assert sparse.to_torch() == pytest.approx(got, abs=1e-6)


def test_alternative_draws_and_top_k_of_sampled_tokens(setup):
    tc, sampler, ids = setup
    n = len(ids)
    prompt = tinker.types.ModelInput.from_ints(ids)
    params = tinker.types.SamplingParams(max_tokens=6, temperature=1.0, seed=11, stop=[])
    res = sampler.sample(prompt, 2, params, prompt_alt_tokens_k=3,
                         topk_sample_logprobs=4).result(timeout=T)
    alt = res.prompt_alt_tokens
    tokens, lps = alt.tokens.to_torch(), alt.logprobs.to_torch()
    assert list(tokens.shape) == [n - 1, 3] and list(lps.shape) == [n - 1, 3]
    assert lps == pytest.approx(_forward_logprobs(tc, ids, tokens.tolist()), abs=1e-4)
    for seq in res.sequences:
        rows = seq.topk_logprobs
        assert len(rows) == len(seq.tokens) == 6
        for tok, lp, row in zip(seq.tokens, seq.logprobs, rows, strict=True):
            assert len(row) == 4 and lp <= row[0][1] + 1e-5
            if tok in [t for t, _ in row]:
                assert dict(row)[tok] == pytest.approx(lp, abs=1e-5)


def test_bad_scoring_requests_are_refused_by_name(setup, daemon):
    _, sampler, ids = setup
    prompt = tinker.types.ModelInput.from_ints(ids)
    params = tinker.types.SamplingParams(max_tokens=1)
    with pytest.raises(tinker.BadRequestError, match="prompt_logprobs_last_n"):
        sampler.sample(prompt, 1, params, include_prompt_logprobs=True,
                       prompt_logprobs_last_n=len(ids)).result(timeout=T)
    with pytest.raises(tinker.BadRequestError, match="topk_prompt_logprobs"):
        sampler.sample(prompt, 1, params, topk_prompt_logprobs=10_000).result(timeout=T)
    short = tinker.types.TensorData.from_torch(torch.zeros((2, 1), dtype=torch.long))
    with pytest.raises(tinker.BadRequestError, match="target_prompt_logprobs"):
        sampler.sample(prompt, 1, params, target_prompt_logprobs=short).result(timeout=T)
    huge = torch.full((len(ids) - 1, 1), 10**9, dtype=torch.long)
    with pytest.raises(tinker.BadRequestError, match="outside the vocabulary"):
        sampler.sample(prompt, 1, params, target_prompt_logprobs=tinker.types.TensorData
                       .from_torch(huge)).result(timeout=T)
    # The sampler still answers.
    ok = sampler.sample(prompt, 1, params, include_prompt_logprobs=True).result(timeout=T)
    assert ok.prompt_logprobs[0] is None and not math.isnan(ok.prompt_logprobs[-1])
