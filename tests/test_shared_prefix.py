"""Shared prefixes (engine/shared_prefix.py): rows of one adapter that begin alike compute
their common start once, and every loss, logprob and gradient equals the unshared path's
(fp32, 1e-5), while the positions computed drop by what the groups share."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    DEVICE,
    all_close,
    assert_bf16_runs_agree,
    centre_on_model,
    grads,
    make_engine,
    randomize_b,
)

from twinkled.engine.losses import LOSSES
from twinkled.engine.shared_prefix import TOKENS, Group, SharedPacking, group_rows, split_group
from twinkled.protocol.types import Datum, ForwardBackwardRequest, LoraConfig

ADAPTERS = {"a": LoraConfig(rank=4, seed=1), "b": LoraConfig(rank=4, seed=2),
            "c": LoraConfig(rank=8, seed=3, train_attn=False)}  # another bank
TOL = 1e-5 if DEVICE == "cpu" else 1e-4


def _engine(tiny_dir, shared: int, budget: int = 16384):
    eng = make_engine(tiny_dir, shared_prefix=shared, token_budget=budget)
    for i, (name, cfg) in enumerate(ADAPTERS.items()):
        eng.add_adapter(name, cfg)
        randomize_b(eng, name, seed=10 + i, std=0.2)
    return eng


class Families:
    """Sequences whose first token is unique to their family, so only the rows built to
    share a start share one (and the expected saving is known)."""

    def __init__(self, vocab: int, seed: int):
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab, self.next = vocab, 1

    def tokens(self, n: int) -> torch.Tensor:
        return torch.randint(0, self.vocab, (n,), generator=self.gen)

    def prompt(self, n: int) -> torch.Tensor:
        p = self.tokens(n)
        p[0], self.next = self.next, self.next + 1
        return p

    def rollouts(self, prompt: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
        """prompt + a completion each; completions start with distinct tokens."""
        firsts = torch.randperm(self.vocab, generator=self.gen)[:len(lengths)]
        out = []
        for f, n in zip(firsts, lengths, strict=True):
            c = self.tokens(n)
            c[0] = f
            out.append(torch.cat([prompt, c]))
        return out


def _datum(seq: torch.Tensor, **inputs) -> Datum:
    return Datum(seq[:-1], {"target_tokens": seq[1:], **inputs})


def _rl(loss: str, seq: torch.Tensor, gen: torch.Generator) -> Datum:
    n = len(seq) - 1
    sampled = (torch.arange(n) >= n // 3).float()
    # Advantages on every position, the shared ones too: each row's count there.
    inputs = {"logprobs": -torch.rand(n, generator=gen) * 3,
              "advantages": torch.randn(n, generator=gen)}
    if loss == "cross_entropy":
        inputs = {"weights": torch.rand(n, generator=gen)}
    elif loss == "gspo":
        inputs["sequence_ratio_mask"] = sampled
    elif loss == "stable_reinforce":
        inputs.update(sampler_logprobs=inputs["logprobs"] * sampled, sampled_mask=sampled,
                      advantages=inputs["advantages"] * sampled)
    return _datum(seq, **inputs)


def _batch(loss: str, vocab: int) -> tuple[list[ForwardBackwardRequest], int]:
    """Three adapters over two banks and the base model: groups sharing starts of several
    lengths (19, 11, 1 positions), whole identical rows, a row that is another's start,
    top-K targets that agree for a while, rows sharing nothing, and the same prompt under
    two adapters (never shared across them). Returns the requests and the positions that
    sharing saves (with the minimum at 1)."""
    f, gen = Families(vocab, 0), torch.Generator().manual_seed(1)
    p20 = f.prompt(20)
    a = f.rollouts(p20, [3, 5, 7, 9])  # 3 x 19 saved
    a += f.rollouts(f.prompt(2), [4, 6, 2])  # 2 x 1
    a += [f.prompt(12)]  # alone
    twin = f.prompt(9)
    a += [twin, twin.clone()]  # 8
    a += f.rollouts(f.prompt(1), [5, 6])  # a 1-token prompt: its next tokens differ: 0
    b = [_datum(s, weights=torch.rand(len(s) - 1, generator=gen))
         for s in f.rollouts(f.prompt(12), [6, 3, 8])]  # 2 x 11
    p10 = f.prompt(10)
    b += [_datum(s, weights=torch.rand(len(s) - 1, generator=gen))
          for s in (p10, *f.rollouts(p10, [5]))]  # the first is the second's start: 9
    top = f.prompt(11)
    for _ in range(2):  # top-K targets agreeing on 6 positions: 6
        targets = torch.randint(0, vocab, (10, 3), generator=torch.Generator().manual_seed(7))
        targets[6:] = torch.randint(0, vocab, (4, 3), generator=gen)
        b.append(Datum(top[:-1], {"target_tokens": targets, "weights": torch.rand(10, 3)}))
    b.append(_datum(top))  # same tokens, one target per position: not with the top-K rows
    c = f.rollouts(p20, [4, 2])  # a's prompt under another adapter: 19 within c only
    base = f.rollouts(f.prompt(5), [3, 3])  # 4
    reqs = [ForwardBackwardRequest("a", [_rl(loss, s, gen) for s in a], loss),
            ForwardBackwardRequest("b", b),
            ForwardBackwardRequest("c", [_rl(loss, s, gen) for s in c], loss),
            ForwardBackwardRequest(None, [_datum(s) for s in base], forward_only=True)]
    return reqs, 3 * 19 + 2 + 8 + 2 * 11 + 9 + 6 + 19 + 4


def _assert_same(want, got, engines) -> None:
    for w, g in zip(want, got, strict=True):
        assert g.metrics["loss:sum"] == pytest.approx(w.metrics["loss:sum"], rel=TOL, abs=TOL)
        for wo, go in zip(w.outputs, g.outputs, strict=True):
            for key in ("logprobs", "elementwise_loss"):
                assert wo[key].shape == go[key].shape, key
                assert torch.allclose(wo[key], go[key], rtol=TOL, atol=TOL), key
    for name in ADAPTERS:  # the rows run apart may take the padded layout, whose fused LoRA
        # (lora_fused.py) sums in another order: ~1e-6 of gradients of size 10-70
        assert all_close(grads(engines[0], name), grads(engines[1], name), 10 * TOL, TOL), name


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_every_loss_equals_the_unshared_path(tiny_dir, loss):
    plain, shared = _engine(tiny_dir, 0), _engine(tiny_dir, 1)
    reqs, saved = _batch(loss, plain.model.vocab_size)
    for r in reqs[0], reqs[2]:  # ratios on both sides of 1 and of the clip range
        if loss != "cross_entropy":
            centre_on_model(plain, r.adapter_id, r.data, torch.Generator().manual_seed(3))
    TOKENS.take()
    want = plain.forward_backward(reqs)
    rows, computed = TOKENS.take()
    assert computed == rows
    got = shared.forward_backward(reqs)
    assert TOKENS.take() == (rows, rows - saved)
    _assert_same(want, got, (plain, shared))


@pytest.mark.parametrize("budget", [16384, 60])  # one micro-batch; groups cut between rows
def test_default_minimum_and_a_small_budget(tiny_dir, budget):
    """At the default minimum (32) only the long prompt's group shares; under a budget
    that holds two of its rows the group is cut, each part computing the prompt again."""
    plain, shared = _engine(tiny_dir, 0, budget), _engine(tiny_dir, 32, budget)
    vocab = plain.model.vocab_size
    f, gen = Families(vocab, 5), torch.Generator().manual_seed(6)
    long = f.rollouts(f.prompt(41), [6, 9, 4, 7, 5])  # 40 shared positions
    short = f.rollouts(f.prompt(20), [5, 5])  # under the minimum
    reqs = [ForwardBackwardRequest("a", [_rl("ppo", s, gen) for s in long + short], "ppo"),
            ForwardBackwardRequest("b", [_datum(s) for s in long])]
    centre_on_model(plain, "a", reqs[0].data, gen)
    want = plain.forward_backward(reqs)
    TOKENS.take()
    got = shared.forward_backward(reqs)
    rows, computed = TOKENS.take()
    saved = rows - computed  # each adapter's 5 rows in one group: 4 x 40; cut: less
    assert saved == 2 * 4 * 40 if budget > 1000 else 0 < saved < 2 * 4 * 40 and saved % 40 == 0
    _assert_same(want, got, (plain, shared))


def test_custom_loss_sees_each_row(tiny_dir):
    """A custom loss gets each datum's logprobs as if unshared, its gradient summed."""
    plain, shared = _engine(tiny_dir, 0), _engine(tiny_dir, 1)
    f = Families(plain.model.vocab_size, 9)
    data = [_datum(s) for s in f.rollouts(f.prompt(15), [4, 6, 3])]

    def loss(_data, lps):
        total = sum((i + 1) * lp.sum() for i, lp in enumerate(lps))
        return total, {"n": float(len(lps))}

    want = plain.forward_backward([ForwardBackwardRequest("a", data, loss)])
    got = shared.forward_backward([ForwardBackwardRequest("a", data, loss)])
    _assert_same(want, got, (plain, shared))


class _R:
    def __init__(self, tokens, adapter=None):
        self.tokens = torch.tensor(tokens)
        self.targets = torch.tensor(tokens[1:] + [0])
        self.adapter = adapter


def test_grouping_and_cutting():
    rows = [_R([1, 2, 3, 4, 5]), _R([9, 9]), _R([1, 2, 3, 7]), _R([1, 2, 3, 4, 6])]
    groups = group_rows(rows, 2)
    assert [(len(g.rows), g.shared) for g in groups] == [(3, 2), (1, 0)]
    assert group_rows(rows, 0)[0].rows[0] is rows[0]  # off: order kept, nothing shared
    g = groups[0]
    assert g.cost == 2 + 3 + 2 + 3
    head, rest = split_group(g, 8, 100)  # shared 2 + 3 + 3 fits; the third row does not
    assert (len(head.rows), head.shared, len(rest.rows), rest.shared) == (2, 2, 1, 0)
    head, rest = split_group(g, 3, 100)  # not even one row: the next micro-batch
    assert head.rows == [] and rest is g
    head, rest = split_group(Group([rows[0]]), 3, 3)  # too long for any: alone
    assert head.rows == [rows[0]] and rest is None


def test_continuations_attend_to_the_shared_keys():
    """A continuation's attention equals its whole row's causal attention (last rows)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 4, generator=gen) for _ in range(3))
    # packed: shared start 0..3, then two continuations of 3 and 2 positions
    packing = SharedPacking.of([(0, 4, 0), (4, 3, 4), (7, 2, 4)], [None, (0, 4), (0, 4)], "cpu")
    out = packing.attend(q, k, v, 0.5, False)
    for rest in (slice(4, 7), slice(7, 9)):
        idx = torch.cat([torch.arange(4), torch.arange(rest.start, rest.stop)])
        whole = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, idx], k[:, :, idx], v[:, :, idx], is_causal=True, scale=0.5)
        assert torch.allclose(out[:, :, rest], whole[:, :, 4:], atol=1e-6)
        assert torch.allclose(out[:, :, :4], whole[:, :, :4], atol=1e-6)
    assert packing.positions.tolist() == [[0, 1, 2, 3, 4, 5, 6, 4, 5]]


def _flash_reference(q, k, v, cu_q, cu_k, max_q, max_k, scale, gqa):
    """Flash attention's varlen semantics: segment i's queries against its keys, causal
    aligned to the keys' end (query j sees keys up to j + keys - queries)."""
    outs = []
    cq, ck = cu_q.tolist(), cu_k.tolist()
    bounds = zip(cq[:-1], cq[1:], ck[:-1], ck[1:], strict=True)
    seen_q = seen_k = 0
    for q0, q1, k0, k1 in bounds:
        nq, nk = q1 - q0, k1 - k0
        seen_q, seen_k = max(seen_q, nq), max(seen_k, nk)
        mask = torch.ones((nq, nk), dtype=torch.bool).tril(nk - nq)
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], attn_mask=mask, scale=scale,
            enable_gqa=gqa))
    assert (seen_q, seen_k) == (max_q, max_k)
    return torch.cat(outs, dim=2)


def test_the_recompute_decision_counts_the_keys_each_continuation_gathers():
    """The flash path copies a group's shared keys once per continuation, kept per layer
    unless layers are recomputed: the memory a pass is judged by counts them (an 8B RL
    group ran out of GPU memory when only the packed tokens were counted)."""
    from twinkled.engine.packed import Packing

    shared = SharedPacking.of([(0, 4, 0), (4, 3, 4), (7, 2, 4)], [None, (0, 4), (0, 4)], "cpu")
    assert shared.memory_tokens() == 9 + (4 + 3) + (4 + 2) + 4  # tokens + gathered keys
    assert Packing.of([4, 3, 2], "cpu").memory_tokens() == 9


def test_the_gpu_kernels_inputs_describe_the_same_attention():
    """What the GPU path hands flash attention (gathered keys, their cumulative lengths,
    the longest segments) gives the CPU path's attention, under GQA too."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 14, 8, generator=gen)
    k, v = (torch.randn(1, 2, 14, 8, generator=gen) for _ in range(2))
    # a row alone (0..2), a shared start (3..7) and three continuations (one of one
    # position), then another row alone
    spans = [(0, 3, 0), (3, 5, 0), (8, 2, 5), (10, 1, 5), (11, 1, 5), (12, 2, 0)]
    packing = SharedPacking.of(spans, [None, None, (3, 5), (3, 5), (3, 5), None], "cpu")
    want = packing.attend(q, k, v, 0.3, True)
    got = packing.attend_varlen(q, k, v, 0.3, True, kernel=_flash_reference)
    assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.skipif(DEVICE == "cpu", reason="the GPU's kernels: flash varlen, bf16 grouped mm")
@pytest.mark.parametrize("loss", ["cross_entropy", "ppo"])
def test_shared_equals_unshared_in_bf16_on_a_gpu(tiny_dir, loss):
    """Where sharing runs for real (flash varlen in bf16), both paths agree to bf16's noise."""
    engines = []
    for shared in (0, 1):
        eng = make_engine(tiny_dir, shared_prefix=shared, dtype="bfloat16")
        for i, (name, cfg) in enumerate(ADAPTERS.items()):
            eng.add_adapter(name, cfg)
            randomize_b(eng, name, seed=10 + i, std=0.2)
        engines.append(eng)
    reqs, _ = _batch(loss, engines[0].model.vocab_size)
    want, got = (e.forward_backward(reqs) for e in engines)
    assert_bf16_runs_agree(engines, want, got, ADAPTERS)


def test_the_planner_counts_a_shared_prefix_once():
    """The daemon's planner fills steps by what datums cost with sharing (protocol/prefixes):
    a rollout after another of its prompt costs its own part only."""
    from twinkled.protocol.frames import DatumF, TrainF, buf
    from twinkled.protocol.prefixes import common_units, datum_costs

    prompt = list(range(100, 140))  # 40 tokens
    seqs = [prompt + [1, 2, 3], prompt + [4, 5], prompt + [4, 5], [7] * 50, prompt[:10] + [9]]
    frame = TrainF("a", [DatumF(buf(s), {}) for s in seqs], "cross_entropy")
    assert common_units(buf(seqs[0]).data, buf(seqs[1]).data) == 40
    # 39 positions shared after the first; a whole identical row shares all but one; the
    # last shares 10 tokens with a row it does not follow: counted whole
    assert datum_costs(frame, 32) == [43, 3, 1, 50, 11]
    assert datum_costs(frame, 41) == [43, 42, 1, 50, 11]  # 39 < 41; identical: 42 >= 41
    assert datum_costs(frame, 0) == [43, 42, 42, 50, 11]


def test_mixture_of_experts(moe_dir):
    """Sparse MLPs (moe.py routes each bank's tokens of the packed sequence) share alike."""
    plain, shared = _engine(moe_dir, 0), _engine(moe_dir, 1)
    reqs, saved = _batch("importance_sampling", plain.model.vocab_size)
    want = plain.forward_backward(reqs)
    TOKENS.take()
    got = shared.forward_backward(reqs)
    rows, computed = TOKENS.take()
    assert rows - computed == saved
    _assert_same(want, got, (plain, shared))


def test_data_parallel_ranks_keep_a_prompts_rollouts_together():
    """Rows split over replicas by cost; a rollout that follows another of its prompt goes
    to the same replica (its prompt computed once there), runs placed by summed cost."""
    from twinkled.engine.parallel import split_rows

    costs = [30, 10, 10, 10, 40, 45, 5]
    follows = [False, True, True, True, False, False, True]
    assert split_rows(costs, 2, follows) == [0, 0, 0, 0, 1, 1, 1]
    assert split_rows(costs, 2) == [1, 0, 0, 0, 1, 0, 1]  # rows alone: the group spread


def test_kv_heads_repeated_token_major_equal_repeat_interleave():
    """The GQA repeat the varlen kernel takes (packed.repeat_kv_heads, one copy straight into
    the token-major layout) is `repeat_interleave` over heads, forward and backward."""
    from twinkled.engine.packed import repeat_kv_heads

    t = torch.randn(1, 2, 7, 4, requires_grad=True)  # [1, Hkv, T, D], as the model holds k
    token_major = t[0].transpose(0, 1)
    got = repeat_kv_heads(token_major, 3)
    want = t.repeat_interleave(3, dim=1)[0].transpose(0, 1)
    assert got.is_contiguous() and torch.equal(got, want)
    w = torch.randn_like(want)
    (g1,) = torch.autograd.grad((got * w).sum(), t)
    (g2,) = torch.autograd.grad((want * w).sum(), t)
    assert torch.allclose(g1, g2)
