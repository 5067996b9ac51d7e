"""A seeded request's draws into a slice of the noise buffer (choose.py's one-kernel path)
are those of a fresh tensor of the same shape, on CPU and (where present) CUDA."""

from __future__ import annotations

import pytest
import torch

from twinkled.engine.choose import RowChoice
from twinkled.protocol.types import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("dev", DEVICES)
def test_a_slice_draws_what_a_fresh_tensor_draws(dev):
    vocab = 151936  # a real vocabulary's width: CUDA's launch shape follows the count
    for rows in (1, 3, 8):
        fresh = torch.Generator(device=dev).manual_seed(7)
        want = torch.empty((rows, vocab), device=dev).exponential_(generator=fresh)
        sliced = torch.Generator(device=dev).manual_seed(7)
        buf = torch.ones((rows + 5, vocab), device=dev)
        buf[2:2 + rows].exponential_(generator=sliced)
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
