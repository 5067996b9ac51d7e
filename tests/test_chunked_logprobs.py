"""The chunked head (chunked_logprobs.py) against the whole-logits reference path: every
loss, a mixed batch of adapters with and without LoRA on lm_head, padded and packed
layouts, chunk boundaries inside rows and a chunk larger than the batch: logprobs,
elementwise losses, loss sums and every adapter's gradients agree to fp32 rounding."""

from __future__ import annotations

import zlib

import pytest
import torch
from helpers import (
    all_close,
    assert_same_results,
    grads,
    loss_data,
    mixed_engine,
    random_datum,
)

from twinkled.engine import chunked_logprobs
from twinkled.engine.chunked_logprobs import chunked_target_logprobs
from twinkled.engine.lora import Segment
from twinkled.engine.losses import LOSSES
from twinkled.protocol.types import ForwardBackwardRequest

# name -> (rank, train_attn, train_mlp, train_unembed); a and b share a bank, c adapts
# only lm_head, d everything but lm_head
ADAPTERS = {"a": (4, True, True, True), "b": (4, True, True, True),
            "c": (8, False, False, True), "d": (4, True, True, False)}


@pytest.fixture(scope="module")
def eng(tiny_dir):
    return mixed_engine(tiny_dir, ADAPTERS)


def _run(eng, requests, chunked: bool):
    eng.model.head = "chunked" if chunked else "full"
    for name in ADAPTERS:
        eng.zero_grad(name)
    results = eng.forward_backward(requests)
    return results, {name: grads(eng, name) for name in ADAPTERS}


# (tokens a chunk, chunks whose softmax is kept): 5 puts boundaries inside rows; None is
# one chunk larger than the batch. Kept 2: the other chunks with lm_head adapters
# recompute their logits in the backward.
CHUNKINGS = [(5, 2), (None, None), (None, 0)]


@pytest.mark.parametrize(("chunk_tokens", "kept"), CHUNKINGS)
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_chunked_head_equals_whole_logits(eng, monkeypatch, loss, layout, chunk_tokens, kept):
    vocab = eng.model.vocab_size
    if chunk_tokens is not None:
        monkeypatch.setattr(chunked_logprobs, "CHUNK_BYTES", 4 * vocab * chunk_tokens)
    if kept is not None:
        monkeypatch.setattr(chunked_logprobs, "KEEP_BYTES", 4 * vocab * (chunk_tokens or 0) * kept)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{loss} {layout}".encode()))
    lengths = {"padded": [[9, 9], [9], [9, 9], [9]],  # one length: rows run padded
               "packed": [[6, 13], [4], [11, 3], [8]]}[layout]
    requests = [ForwardBackwardRequest(name, loss_data(eng, gen, loss, name, n), loss)
                for name, n in zip(ADAPTERS, lengths, strict=True)]
    ref, ref_grads = _run(eng, requests, chunked=False)

    def whole_logits(*a, **k):
        raise AssertionError("the chunked path computed the whole logits")

    monkeypatch.setattr(eng.model, "logits", whole_logits)
    ours, our_grads = _run(eng, requests, chunked=True)
    assert_same_results(ref, ours)
    for name in ADAPTERS:
        # non-trivial gradients in every module, lm_head included
        zero = [k for k, (a, b) in ref_grads[name].items() if not b.abs().sum() > 0]
        assert not zero, (name, zero)
        assert all_close(our_grads[name], ref_grads[name], rtol=1e-4, atol=1e-7), name


def test_head_only_adapter_trains_alone(eng):
    """An adapter with LoRA only on lm_head: the hidden states need no gradient, and the
    LoRA batch's anchor still puts the chunked head on the graph."""
    gen = torch.Generator().manual_seed(3)
    req = [ForwardBackwardRequest("c", loss_data(eng, gen, "cross_entropy", "c", [7, 7]))]
    ref, ref_grads = _run(eng, req, chunked=False)
    ours, our_grads = _run(eng, req, chunked=True)
    assert ref_grads["c"]["lm_head"][1].abs().sum() > 0
    assert all_close(our_grads["c"], ref_grads["c"], rtol=1e-4, atol=1e-7)
    assert torch.allclose(ours[0].outputs[0]["logprobs"], ref[0].outputs[0]["logprobs"],
                          atol=1e-5)


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("chunk_tokens", [1, 4, 64])
@pytest.mark.parametrize("k", [None, 3])
def test_chunked_head_against_autograd(monkeypatch, chunk_tokens, k, keep):
    """The function alone, with a bias, K targets and segments that start and end inside
    chunks, against autograd through log_softmax of the whole logits; chunks with
    adapters keep their softmax or compute it again in the backward."""
    if not keep:
        monkeypatch.setattr(chunked_logprobs, "KEEP_BYTES", 0)
    gen = torch.Generator().manual_seed(chunk_tokens * 7 + (k or 0))
    B, S, H, V, r = 3, 10, 16, 50, 4
    hidden = torch.randn(B, S, H, generator=gen, requires_grad=True)
    weight, bias = torch.randn(V, H, generator=gen), torch.randn(V, generator=gen)
    targets = torch.randint(0, V, (B, S) if k is None else (B, S, k), generator=gen)
    g = torch.randn(targets.shape, generator=gen)
    spans = [(3, 11, 0.5), (11, 12, 2.0), (17, 30, 1.0)]  # tokens 0-2 and 12-16: base only
    A = [torch.randn(r, H, generator=gen, requires_grad=True) for _ in spans]
    Bw = [torch.randn(V, r, generator=gen, requires_grad=True) for _ in spans]
    segs = [Segment(s, e, a.detach(), b.detach(), torch.zeros(r, H), torch.zeros(V, r), sc)
            for (s, e, sc), a, b in zip(spans, A, Bw, strict=True)]

    lp = chunked_target_logprobs(hidden, targets, weight, bias, segs,
                                 chunk_bytes=4 * V * chunk_tokens)
    (lp * g).sum().backward()
    ours = hidden.grad.clone()
    hidden.grad = None

    flat = hidden.reshape(-1, H)
    logits = [flat @ weight.t() + bias]
    for (s, e, sc), a, b in zip(spans, A, Bw, strict=True):
        delta = torch.zeros(B * S, V)
        delta[s:e] = (flat[s:e] @ a.t()) * sc @ b.t()
        logits.append(delta)
    ref_logits = sum(logits).view(B, S, V)
    tgt = targets if k is not None else targets[..., None]
    ref = torch.log_softmax(ref_logits, -1).gather(2, tgt).view(targets.shape)
    (ref * g).sum().backward()
    assert torch.allclose(lp, ref, atol=1e-5)
    assert torch.allclose(ours, hidden.grad, atol=1e-5)
    for seg, a, b in zip(segs, A, Bw, strict=True):
        assert torch.allclose(seg.gA, a.grad, atol=1e-4, rtol=1e-5)
        assert torch.allclose(seg.gB, b.grad, atol=1e-4, rtol=1e-5)


def test_forward_only_equals_log_softmax():
    gen = torch.Generator().manual_seed(4)
    hidden, weight = torch.randn(2, 5, 8, generator=gen), torch.randn(30, 8, generator=gen)
    tgt = torch.randint(0, 30, (2, 5), generator=gen)
    with torch.no_grad():
        lp = chunked_target_logprobs(hidden, tgt, weight, None, [], chunk_bytes=4 * 30 * 3)
    ref = torch.log_softmax(hidden @ weight.t(), -1).gather(2, tgt[..., None])[..., 0]
    assert not lp.requires_grad
    assert torch.allclose(lp, ref, atol=1e-6)


def test_auto_takes_the_chunked_head_only_for_big_logits(eng, monkeypatch):
    """"auto" (the engine's default) runs the whole logits while they are small (faster
    there) and the chunked head above FULL_LOGITS_MAX."""
    eng.model.head = "auto"
    calls = []
    whole = eng.model.logits
    monkeypatch.setattr(eng.model, "logits", lambda *a, **k: calls.append(1) or whole(*a, **k))
    gen = torch.Generator().manual_seed(5)
    req = [ForwardBackwardRequest("a", [random_datum(gen, 6, eng.model.vocab_size)])]
    eng.forward_backward(req)
    assert calls  # 6 tokens of the tiny vocabulary: the whole logits
    calls.clear()
    monkeypatch.setattr(chunked_logprobs, "FULL_LOGITS_MAX", 6 * eng.model.vocab_size * 4 - 1)
    eng.forward_backward(req)
    assert not calls
