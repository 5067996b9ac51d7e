"""The lone-adapter fast path (lora_fused.lone_deltas: rows or packed tokens that all use
one adapter take plain matmuls on its slot's views, no gathers, no index_add) against the
gathered path every mixture takes (lora.DIRECT = False): every loss, in the padded layout
(LoraBatch: a mixed batch whose banks hold one adapter or several, beside base-model
rows, and one adapter alone) and the packed one (PackedLora, shared prefixes too):
logprobs, elementwise losses, loss sums and every adapter's gradients agree to fp32
rounding; forward-only passes too."""

from __future__ import annotations

import zlib

import pytest
import torch
from helpers import all_close, assert_same_results, grads, loss_data, mixed_engine

from twinkled.engine import lora, lora_fused
from twinkled.engine.lora_fused import LoneDelta
from twinkled.engine.losses import LOSSES
from twinkled.protocol.types import Datum, ForwardBackwardRequest

# name -> (rank, train_attn, train_mlp, train_unembed); a, b and c share a bank (slots
# 0, 1, 2), m and t are alone in theirs
ADAPTERS = {"a": (4, True, True, True), "b": (4, True, True, True),
            "c": (4, True, True, True), "m": (8, False, True, False),
            "t": (2, True, False, True)}


@pytest.fixture(scope="module")
def eng(tiny_dir):
    return mixed_engine(tiny_dir, ADAPTERS)


def _run(eng, monkeypatch, requests, direct: bool, forward_only: bool = False):
    monkeypatch.setattr(lora, "DIRECT", direct)
    for name in ADAPTERS:
        eng.zero_grad(name)
    results = (eng.forward if forward_only else eng.forward_backward)(requests)
    return results, {name: grads(eng, name) for name in ADAPTERS}


def _compare(eng, monkeypatch, requests, trained: list[str]) -> None:
    calls = []
    original = LoneDelta.forward
    monkeypatch.setattr(LoneDelta, "forward", staticmethod(
        lambda *a: calls.append(1) or original(*a)))
    ref, ref_grads = _run(eng, monkeypatch, requests, direct=False)
    assert not calls
    ours, our_grads = _run(eng, monkeypatch, requests, direct=True)
    assert calls  # the fast path ran
    assert_same_results(ref, ours, tol=1e-4)
    for name in ADAPTERS:
        if name in trained:
            zero = [k for k, (a, b) in ref_grads[name].items() if not a.abs().sum() > 0]
            assert not zero, (name, zero)
        assert all_close(our_grads[name], ref_grads[name], rtol=1e-4, atol=1e-7), name
    fwd_ref, _ = _run(eng, monkeypatch, requests, direct=False, forward_only=True)
    fwd_ours, _ = _run(eng, monkeypatch, requests, direct=True, forward_only=True)
    assert_same_results(fwd_ref, fwd_ours, tol=1e-4)


def _requests(eng, loss: str, lengths: dict[str, list[int]], base: list[int] = ()):
    gen = torch.Generator().manual_seed(zlib.crc32(loss.encode()))
    reqs = [ForwardBackwardRequest(name, loss_data(eng, gen, loss, name, n), loss)
            for name, n in lengths.items()]
    if base:  # base-model rows (forward only): the adapters' groups are then not whole
        reqs.append(ForwardBackwardRequest(None, loss_data(eng, gen, "cross_entropy", "a",
                                                           list(base)), forward_only=True))
    return reqs


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("shared", ["gathered", "slice"])
def test_direct_paths_equal_the_gathered_path_in_a_mixed_batch(eng, monkeypatch, loss,
                                                                shared):
    """Padded rows (one length), base rows first, then a bank of two adapters, then two
    banks of one adapter each (lone). The shared bank's rows are a, a, b (gathered either
    way) or b, c: distinct consecutive slots, read and accumulated as a slice. (a's
    cross-entropy data hold a top-K datum besides.)"""
    lengths = {"a": [8, 8], "b": [8]} if shared == "gathered" else {"b": [8], "c": [8]}
    lengths.update(m=[8, 8], t=[8])
    rows = []
    original = lora_fused.accumulate

    def spy(buf, at, a, b):
        rows.append(at)
        return original(buf, at, a, b)

    monkeypatch.setattr(lora_fused, "accumulate", spy)
    _compare(eng, monkeypatch, _requests(eng, loss, lengths, base=[8]), list(lengths))
    sliced = {at is None for at in rows}
    assert sliced == ({False} if shared == "gathered" else {False, True})


@pytest.mark.parametrize("loss", ["cross_entropy", "ppo"])
@pytest.mark.parametrize("lengths", [[8, 8], [5, 12, 9]], ids=["padded", "packed"])
def test_lone_path_equals_the_gathered_path_for_one_adapter(eng, monkeypatch, loss, lengths):
    """A lone tenant: the whole batch is one adapter's (its q/k/v and gate/up A's stacked,
    every base output taking its delta inside the B matmul); rows of several lengths run
    packed, with lm_head adapted too."""
    _compare(eng, monkeypatch, _requests(eng, loss, {"a": lengths}), ["a"])
    _compare(eng, monkeypatch, _requests(eng, loss, {"m": lengths, "t": [7]}), ["m", "t"])


def test_lone_path_with_shared_prefixes(eng, monkeypatch):
    """Packed rows of one adapter that share a 40-token start (shared_prefix.py) beside a
    mixed bank: the shared segment and each row's rest are one adapter's span."""
    gen = torch.Generator().manual_seed(7)
    vocab = eng.model.vocab_size
    prompt = torch.randint(1, vocab, (40,), generator=gen)
    data = []
    for n in (9, 14, 6):
        seq = torch.cat([prompt, torch.randint(1, vocab, (n,), generator=gen)])
        data.append(Datum(seq[:-1], {"target_tokens": seq[1:],
                                     "weights": torch.rand(len(seq) - 1, generator=gen)}))
    reqs = [ForwardBackwardRequest("m", data),
            ForwardBackwardRequest("a", loss_data(eng, gen, "cross_entropy", "a", [20])),
            ForwardBackwardRequest("b", loss_data(eng, gen, "cross_entropy", "b", [11]))]
    _compare(eng, monkeypatch, reqs, ["m", "a", "b"])


def test_direct_paths_in_bfloat16(tiny_dir, monkeypatch):
    """As the GPU runs them: bf16 activations and weights, fp32 gradient buffers (the
    direct paths add bf16 products into them without a cast). A lone adapter and a slice
    of two, padded and packed, against the gathered path, to bf16 rounding (the direct
    path rounds once where the gathered one rounds the delta, then the sum)."""
    eng = mixed_engine(tiny_dir, ADAPTERS, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    for lengths in ({"m": [8, 8]}, {"b": [8], "c": [8]}, {"m": [5, 12, 9]},
                    {"b": [5], "c": [12]}):
        reqs = [ForwardBackwardRequest(name, loss_data(eng, gen, "cross_entropy", name, n))
                for name, n in lengths.items()]
        ref, ref_grads = _run(eng, monkeypatch, reqs, direct=False)
        ours, our_grads = _run(eng, monkeypatch, reqs, direct=True)
        assert_same_results(ref, ours, tol=2e-2)
        for name in lengths:
            assert ref_grads[name]["model.layers.0.mlp.up_proj"][0].abs().sum() > 0
            assert all_close(our_grads[name], ref_grads[name], rtol=2e-2, atol=1e-6), name


def test_scratch_gradients_reach_the_fp32_buffer_before_any_read():
    """A bf16 bank's lone-path backward leaves gradients in its compute-dtype scratch;
    whatever reads the fp32 gradients (optimizer, norms, all-reduce) sees them added, once,
    and zeroing the slot's gradients drops what waits there."""
    bank = lora.Bank(2, {"q": (4, 6)}, "cpu", torch.bfloat16)
    slot = bank.allocate()
    gs = bank.part(bank.scratch(), "A", "q")[slot]
    bank.mark(slot)
    gs.fill_(0.5)
    assert torch.equal(bank.flat(slot, "g")[:8], torch.full((8,), 0.5))
    assert not gs.any() and not bank.dirty  # flushed once
    assert torch.equal(bank.tensors(slot, "g")[0], torch.full((2, 4), 0.5))
    bank.mark(slot)
    gs.fill_(1.0)
    bank.zero_slot(slot)
    assert not bank.flat(slot, "g").any() and not gs.any()
