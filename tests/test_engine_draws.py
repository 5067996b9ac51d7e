"""A seeded request's draws into a slice of the noise buffer (choose.py's one-kernel path)
are those of a fresh tensor of the same shape, on CPU and (where present) CUDA."""

from __future__ import annotations

import pytest
import torch

from twinkled.engine.choose import RowChoice, exponential
from twinkled.protocol.types import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("dev", DEVICES)
def test_a_slice_draws_what_a_fresh_tensor_draws(dev):
    vocab = 151936  # a real vocabulary's width: CUDA's launch shape follows the count
    for rows in (1, 3, 8):
        fresh = torch.Generator(device=dev).manual_seed(7)
        want = exponential(torch.empty((rows, vocab), device=dev), fresh)
        sliced = torch.Generator(device=dev).manual_seed(7)
        buf = torch.ones((rows + 5, vocab), device=dev)
        exponential(buf[2:2 + rows], sliced)
        assert torch.equal(buf[2:2 + rows], want)
        assert torch.equal(fresh.get_state(), sliced.get_state())  # the stream goes on alike


@pytest.mark.parametrize("dev", DEVICES)
def test_consecutive_and_scattered_rows_choose_alike(dev):
    """The same request's rows sampled in consecutive slots (slice) and scattered ones
    (index) give the same tokens."""
    p = SamplingParams(max_tokens=4, seed=3)
    logits = torch.randn(6, 4096, device=dev)
    gens = [torch.Generator(device=dev).manual_seed(3) for _ in range(2)]
    together = RowChoice.of([p] * 6, [([1, 2, 3], gens[0])], torch.device(dev))
    apart = RowChoice.of([p] * 6, [([1, 3, 5], gens[1])], torch.device(dev))
    assert isinstance(together.groups[0][0], slice)
    assert isinstance(apart.groups[0][0], torch.Tensor)
    order = torch.tensor([0, 1, 4, 2, 5, 3], device=dev)  # rows 1,2,3 -> slots 1,3,5
    a = together.choose(logits)[0][1:4]
    b = apart.choose(logits[order])[0][torch.tensor([1, 3, 5], device=dev)]
    assert torch.equal(a, b)


def _reference(params, groups, logits):
    """choose.py's choice as it was before it skipped passes (the division by every row's
    temperature, the greedy argmax, ones for rows outside a group) and drew into slices."""
    dev = logits.device
    temp = torch.tensor([p.temperature for p in params], device=dev)
    greedy = temp == 0
    logp = torch.log_softmax(logits.float() / torch.where(greedy, 1.0, temp)[:, None], dim=-1)
    choice = RowChoice.of(params, [], dev)
    probs = (choice._filter(logp) if choice.filtered else logp).exp()
    noise = torch.ones_like(probs)
    for idx, gen in groups:
        noise[torch.tensor(idx, device=dev)] = exponential(torch.empty(
            (len(idx), probs.shape[1]), device=dev), gen)
    tokens = torch.where(greedy, logp.argmax(-1), (probs / noise).argmax(-1))
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", ["all hot", "mixed", "filtered", "ungrouped"])
def test_choose_picks_what_the_unabridged_choice_picks(dev, case):
    """Skipping the passes that change nothing (temperature 1, no greedy row, every row
    drawn) leaves every token and logprob as they were, bit for bit."""
    hot, cold = SamplingParams(seed=1), SamplingParams(temperature=0.0)
    params, groups = {
        "all hot": ([hot] * 5, [[0, 1, 2], [3, 4]]),
        "mixed": ([hot, cold, SamplingParams(temperature=0.7, seed=2), hot, hot],
                  [[0, 3], [2], [4]]),
        "filtered": ([SamplingParams(seed=1, top_k=20)] * 2 + [SamplingParams(top_p=0.5)] * 3,
                     [[0, 1], [2, 3, 4]]),
        "ungrouped": ([hot] * 5, [[0, 1], [3]]),  # rows 2, 4: noise 1, the argmax of probs
    }[case]
    logits = torch.randn(5, 3000, device=dev, generator=torch.Generator(dev).manual_seed(0)) * 3
    got, want = [], []
    for out, fn in ((got, lambda gs: RowChoice.of(params, gs, torch.device(dev)).choose(
            logits)[:2]), (want, lambda gs: _reference(params, gs, logits))):
        gens = [torch.Generator(device=dev).manual_seed(10 + i) for i in range(len(groups))]
        out.extend(fn(list(zip(groups, gens, strict=True))))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dev", DEVICES)
def test_draws_are_exp1_and_tokens_follow_the_distribution(dev):
    """choose.py's noise is Exp(1) (the CPU makes it as -log U), so the argmax of probs /
    noise draws each token with its probability."""
    gen = torch.Generator(device=dev).manual_seed(5)
    x = exponential(torch.empty(1 << 20, device=dev), gen)
    assert x.min() >= 0
    assert abs(x.mean().item() - 1) < 0.01 and abs(x.std().item() - 1) < 0.01
    assert abs((x > 1).float().mean().item() - 0.36788) < 0.005  # P(X > 1) = 1/e
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], device=dev)
    rows = 40000
    choice = RowChoice.of([SamplingParams(seed=9)] * rows, [(list(range(rows)),
                          torch.Generator(device=dev).manual_seed(9))], torch.device(dev))
    tokens = choice.choose(probs.log().expand(rows, 4).contiguous())[0]
    freq = torch.bincount(tokens, minlength=4).float() / rows
    assert torch.allclose(freq, probs, atol=0.01), freq
