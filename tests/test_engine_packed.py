"""Packing without padding: a micro-batch's rows end to end (engine/packed.py) give the
same logprobs, losses and gradients as the same rows right-padded (fp32, 1e-5)."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    DEVICE,
    all_close,
    assert_bf16_runs_agree,
    assert_same_results,
    grads,
    make_engine,
    random_datum,
    randomize_b,
    rl_datum,
)

from twinkled.engine.packed import grouped_mm, grouped_weight_grad
from twinkled.protocol.types import Datum, ForwardBackwardRequest, LoraConfig

ADAPTERS = {"a": LoraConfig(rank=4, seed=1), "b": LoraConfig(rank=4, seed=2),
            "c": LoraConfig(rank=8, seed=3, train_attn=False)}  # another bank


def _engine(tiny_dir, packed: bool, token_budget: int = 16384):
    eng = make_engine(tiny_dir, packed=packed, token_budget=token_budget)
    for i, (name, cfg) in enumerate(ADAPTERS.items()):
        eng.add_adapter(name, cfg)
        randomize_b(eng, name, seed=10 + i, std=0.2)
    return eng


def _requests(vocab: int) -> list[ForwardBackwardRequest]:
    """Rows of mixed lengths, three adapters over two banks, a base-model forward, an RL
    loss and top-K targets: everything a shared step may hold."""
    gen = torch.Generator().manual_seed(4)
    lengths = [int(x) for x in torch.randint(1, 40, (9,), generator=gen)]
    top_k = random_datum(gen, 11, vocab)
    top_k.loss_inputs = {"target_tokens": torch.randint(0, vocab, (11, 3), generator=gen),
                         "weights": torch.rand(11, 3, generator=gen)}
    return [
        ForwardBackwardRequest("a", [random_datum(gen, n, vocab) for n in lengths[:3]]),
        ForwardBackwardRequest("b", [rl_datum(gen, n, vocab) for n in lengths[3:6]], "ppo"),
        ForwardBackwardRequest("c", [random_datum(gen, n, vocab) for n in lengths[6:]] + [top_k]),
        ForwardBackwardRequest(None, [random_datum(gen, 17, vocab)], forward_only=True),
        ForwardBackwardRequest("a", [Datum(torch.tensor([5]), {"target_tokens": torch.tensor([6])})]),
    ]


@pytest.mark.parametrize("budget", [16384, 40])  # one micro-batch; several
def test_packed_equals_padded(tiny_dir, budget):
    padded, packed = _engine(tiny_dir, False, budget), _engine(tiny_dir, True, budget)
    reqs = _requests(padded.model.vocab_size)
    want, got = padded.forward_backward(reqs), packed.forward_backward(reqs)
    assert_same_results(want, got)
    # fp32 on a CPU (CI): 1e-5. A GPU's fp32 kernels sum in other orders per layout.
    tol = 1e-5 if DEVICE == "cpu" else 1e-4
    for name in ADAPTERS:
        assert all_close(grads(padded, name), grads(packed, name), rtol=tol, atol=tol), name


def test_grouped_matmuls_equal_per_group_matmuls():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(13, 8, generator=gen)
    w = torch.randn(3, 8, 4, generator=gen)
    offs = torch.tensor([2, 9, 13], dtype=torch.int32)
    parts = [(0, 2), (2, 9), (9, 13)]
    want = torch.cat([x[a:b] @ w[g] for g, (a, b) in enumerate(parts)])
    assert torch.allclose(grouped_mm(x, w, offs), want, atol=1e-6)
    g = torch.randn(13, 4, generator=gen)
    want_w = torch.stack([x[a:b].t() @ g[a:b] for a, b in parts])
    assert torch.allclose(grouped_weight_grad(x, g, offs), want_w, atol=1e-5)
    odd = torch.randn(13, 3, generator=gen)  # rows the grouped kernel refuses: the loop
    assert torch.allclose(grouped_weight_grad(x, odd, offs),
                          torch.stack([x[a:b].t() @ odd[a:b] for a, b in parts]), atol=1e-5)


@pytest.mark.skipif(DEVICE == "cpu", reason="the GPU's kernels: flash varlen, bf16 grouped mm")
def test_packed_equals_padded_in_bf16_on_a_gpu(tiny_dir):
    """Where packing runs for real (a GPU in bf16), the two layouts agree to bf16's noise."""
    engines = []
    for packed in (False, True):
        eng = make_engine(tiny_dir, packed=packed, dtype="bfloat16")
        for i, (name, cfg) in enumerate(ADAPTERS.items()):
            eng.add_adapter(name, cfg)
            randomize_b(eng, name, seed=10 + i, std=0.2)
        engines.append(eng)
    reqs = _requests(engines[0].model.vocab_size)
    want, got = (e.forward_backward(reqs) for e in engines)
    assert_bf16_runs_agree(engines, want, got, ADAPTERS)
