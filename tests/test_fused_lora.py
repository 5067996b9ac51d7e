"""Fused LoRA for modules that read the same input (lora_fused.py: one A matmul for q/k/v,
one for gate/up) against one matmul per module: every loss, a mixed batch of adapters
with different module sets and ranks, in the padded layout (LoraBatch) where it runs:
logprobs, elementwise losses, loss sums and every adapter's gradients agree to fp32
rounding; forward-only passes too."""

from __future__ import annotations

import zlib

import pytest
import torch
from helpers import all_close, assert_same_results, grads, loss_data, mixed_engine

from twinkled.engine.lora import _LoraDelta
from twinkled.engine.lora_fused import SharedDelta
from twinkled.engine.losses import LOSSES
from twinkled.protocol.types import ForwardBackwardRequest

# name -> (rank, train_attn, train_mlp, train_unembed); a and b share a bank
ADAPTERS = {"a": (4, True, True, True), "b": (4, True, True, True),
            "m": (8, False, True, False), "t": (2, True, False, True)}


@pytest.fixture(scope="module")
def eng(tiny_dir):
    return mixed_engine(tiny_dir, ADAPTERS)


def _run(eng, requests, fuse: bool, forward_only: bool = False):
    eng.model.fuse_lora = fuse
    for name in ADAPTERS:
        eng.zero_grad(name)
    results = (eng.forward if forward_only else eng.forward_backward)(requests)
    return results, {name: grads(eng, name) for name in ADAPTERS}


@pytest.mark.parametrize("loss", list(LOSSES))
def test_fused_lora_equals_one_matmul_per_module(eng, monkeypatch, loss):
    gen = torch.Generator().manual_seed(zlib.crc32(loss.encode()))
    requests = [ForwardBackwardRequest(name, loss_data(eng, gen, loss, name, n), loss)
                for name, n in zip(ADAPTERS, ([8, 8], [8], [8, 8], [8]), strict=True)]
    calls = []
    original = SharedDelta.forward
    monkeypatch.setattr(SharedDelta, "forward", staticmethod(
        lambda *a: calls.append(1) or original(*a)))
    ref, ref_grads = _run(eng, requests, fuse=False)
    assert not calls
    ours, our_grads = _run(eng, requests, fuse=True)
    assert calls  # the fused path ran
    # fp32: the stacked matmul sums in another order; logprobs (~ -23) differ by ~1e-6
    # and ppo's sum of ratio * advantage by ~1e-5
    assert_same_results(ref, ours, tol=1e-4)
    for name in ADAPTERS:
        zero = [k for k, (a, b) in ref_grads[name].items() if not a.abs().sum() > 0]
        assert not zero, (name, zero)
        assert all_close(our_grads[name], ref_grads[name], rtol=1e-4, atol=1e-7), name
    fwd_ref, _ = _run(eng, requests, fuse=False, forward_only=True)
    fwd_ours, _ = _run(eng, requests, fuse=True, forward_only=True)
    assert_same_results(fwd_ref, fwd_ours, tol=1e-4)


def test_shared_delta_equals_a_delta_per_module():
    """The function alone: each module's output, its bank gradients and x's gradient."""
    gen = torch.Generator().manual_seed(1)
    n, S, fin, r, outs = 3, 5, 12, 4, (12, 6, 6)
    x = torch.randn(n, S, fin, generator=gen, requires_grad=True)
    slots, scale = torch.tensor([2, 0, 2]), torch.tensor([0.5, 2.0, 0.5]).view(-1, 1, 1)
    A = [torch.randn(n, r, fin, generator=gen) for _ in outs]
    B = [torch.randn(n, o, r, generator=gen) for o in outs]
    gy = [torch.randn(n, S, o, generator=gen) for o in outs]
    banks = [[(torch.zeros(3, r, fin), torch.zeros(3, o, r)) for o in outs] for _ in range(2)]
    anchor = torch.zeros((), requires_grad=True)
    ys = SharedDelta.apply(x, anchor, torch.cat(A, 1), slots, scale, (None, banks[0]), tuple(B))
    sum((y * g).sum() for y, g in zip(ys, gy, strict=True)).backward()
    fused_x, x.grad = x.grad, None
    refs = [_LoraDelta.apply(x, anchor, a, b, ga, gb, slots, scale)
            for a, b, (ga, gb) in zip(A, B, banks[1], strict=True)]
    sum((y * g).sum() for y, g in zip(refs, gy, strict=True)).backward()
    for y, ref in zip(ys, refs, strict=True):
        assert torch.allclose(y, ref, atol=1e-5)
    assert torch.allclose(fused_x, x.grad, atol=1e-5)
    for (ga, gb), (ra, rb) in zip(banks[0], banks[1], strict=True):
        assert ga.abs().sum() > 0 and torch.allclose(ga, ra, atol=1e-4)
        assert torch.allclose(gb, rb, atol=1e-4)
