"""Gradient accumulation and per-adapter AdamW with Tinker's AdamParams."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    adapter_snapshot,
    all_close,
    ce_request,
    grads,
    make_engine,
    randomize_b,
    weights,
)

from twinkled.protocol.types import AdamParams, EngineInputError, ForwardBackwardRequest, LoraConfig


@pytest.fixture()
def eng(tiny_dir):
    e = make_engine(tiny_dir)
    for i, name in enumerate("ab"):
        e.add_adapter(name, LoraConfig(rank=4, seed=i))
        randomize_b(e, name, seed=10 + i)
    return e


def test_gradients_accumulate_until_the_step(eng, tiny_dir):
    gen = torch.Generator().manual_seed(0)
    v = eng.model.vocab_size
    r1, r2 = ce_request("a", gen, v, [7, 9]), ce_request("a", gen, v, [12])
    eng.forward_backward([r1])
    eng.forward_backward([r2])
    assert eng.pool.get("a").pending == 3
    other = make_engine(tiny_dir)
    other.add_adapter("a", LoraConfig(rank=4, seed=0))
    randomize_b(other, "a", seed=10)
    other.forward_backward([ForwardBackwardRequest("a", r1.data + r2.data)])
    assert all_close(grads(eng, "a"), grads(other, "a"))
    # The other adapter in the same engine got nothing.
    assert all(t.abs().max() == 0 for pair in grads(eng, "b").values() for t in pair)


def test_adamw_matches_torch_with_changing_hyperparameters(eng):
    gen = torch.Generator().manual_seed(1)
    v = eng.model.vocab_size
    a = eng.pool.get("a")
    ref = [t.detach().cpu().clone().requires_grad_(True) for t in a.bank.tensors(a.slot, "w")]
    opt = torch.optim.AdamW(ref, foreach=False)
    schedule = [AdamParams(learning_rate=1e-2, weight_decay=0.1),
                AdamParams(learning_rate=5e-3, beta1=0.8, beta2=0.99, eps=1e-8),
                AdamParams(learning_rate=2e-2, grad_clip_norm=0.5)]
    for params in schedule:
        eng.forward_backward([ce_request("a", gen, v, [10, 6])])
        g = [t.cpu().clone() for t in a.bank.tensors(a.slot, "g")]
        for p, gi in zip(ref, g, strict=True):
            p.grad = gi.clone()
        norm = torch.nn.utils.clip_grad_norm_(ref, params.grad_clip_norm or float("inf"))
        opt.param_groups[0].update(lr=params.learning_rate, betas=(params.beta1, params.beta2),
                                   eps=params.eps, weight_decay=params.weight_decay)
        opt.step()
        res = eng.optim_step("a", params)
        assert res.applied
        assert res.metrics["grad_norm:mean"] == pytest.approx(norm.item(), rel=1e-5)
        ours = [t.cpu() for t in a.bank.tensors(a.slot, "w")]
        assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(ours, ref, strict=True))
        # Gradients are cleared by the step.
        assert all(t.abs().max() == 0 for t in a.bank.tensors(a.slot, "g"))
    assert eng.adapter_info("a").steps == 3


def test_clipping_bounds_the_update(eng):
    gen = torch.Generator().manual_seed(2)
    eng.forward_backward([ce_request("a", gen, eng.model.vocab_size, [10])])
    res = eng.optim_step("a", AdamParams(grad_clip_norm=1e-3))
    assert res.metrics["grad_norm:mean"] > 1e-3  # reported before clipping
    # A fresh adapter's first moment after one step is (1 - beta1) * the gradient it used:
    # that gradient's norm is the clip norm, not the reported one.
    m = torch.cat([t.reshape(-1) for k, t in adapter_snapshot(eng, "a").items() if k[0] == "m"])
    assert (m.norm() / (1 - AdamParams().beta1)).item() == pytest.approx(1e-3, rel=1e-2)


def test_step_without_gradients_is_a_no_op_that_says_so(eng):
    before = adapter_snapshot(eng, "a")
    res = eng.optim_step("a")
    assert not res.applied and "no pending gradients" in res.metrics["reason"]
    after = adapter_snapshot(eng, "a")
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert eng.adapter_info("a").steps == 0


def test_step_touches_only_its_adapter(eng):
    gen = torch.Generator().manual_seed(3)
    v = eng.model.vocab_size
    eng.forward_backward([ce_request("a", gen, v, [8]), ce_request("b", gen, v, [8])])
    b_before = weights(eng, "b")
    eng.optim_step("a", AdamParams(learning_rate=0.1))
    b_after = weights(eng, "b")
    assert all(torch.equal(b_before[k][i], b_after[k][i]) for k in b_before for i in range(2))
    assert eng.pool.get("b").pending == 1  # still waiting for its own step


def test_zero_grad_discards_pending_gradients(eng):
    gen = torch.Generator().manual_seed(4)
    eng.forward_backward([ce_request("a", gen, eng.model.vocab_size, [8])])
    eng.zero_grad("a")
    assert not eng.optim_step("a").applied


@pytest.mark.parametrize("bad", [
    AdamParams(learning_rate=float("nan")), AdamParams(learning_rate=-1.0),
    AdamParams(beta1=1.0), AdamParams(beta2=-0.1), AdamParams(eps=-1.0),
    AdamParams(grad_clip_norm=float("inf")),
])
def test_bad_adam_params_are_refused_and_change_nothing(eng, bad):
    gen = torch.Generator().manual_seed(5)
    eng.forward_backward([ce_request("a", gen, eng.model.vocab_size, [8])])
    before = adapter_snapshot(eng, "a")
    with pytest.raises(EngineInputError, match="adam_params"):
        eng.optim_step("a", bad)
    after = adapter_snapshot(eng, "a")
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert eng.pool.get("a").pending == 1


def test_stepping_many_adapters_at_once_equals_one_by_one(tiny_dir):
    engines = []
    for _ in range(2):
        e = make_engine(tiny_dir)
        for i, name in enumerate("abc"):
            e.add_adapter(name, LoraConfig(rank=4, seed=i))
        gen = torch.Generator().manual_seed(6)
        e.forward_backward([ce_request(n, gen, e.model.vocab_size, [7]) for n in "abc"])
        engines.append(e)
    params = {"a": AdamParams(learning_rate=1e-2), "b": AdamParams(learning_rate=1e-2),
              "c": AdamParams(learning_rate=3e-3, grad_clip_norm=0.1)}
    together = engines[0].optim_steps(list(params.items()))
    apart = [engines[1].optim_step(n, p) for n, p in params.items()]
    for n, x, y in zip(params, together, apart, strict=True):
        assert x.applied and x.metrics == y.metrics
        a, b = weights(engines[0], n), weights(engines[1], n)
        assert all(torch.equal(a[k][i], b[k][i]) for k in a for i in range(2))
    with pytest.raises(EngineInputError, match="only once per call"):
        engines[0].optim_steps([("a", AdamParams()), ("a", AdamParams())])


def test_bf16_engine_uses_the_updated_weights(tiny_dir, tmp_path):
    """Batches run on a bf16 copy of the fp32 masters: it must follow every change."""
    eng = make_engine(tiny_dir, dtype="bfloat16")
    eng.add_adapter("a", LoraConfig(rank=4, seed=0))
    gen = torch.Generator().manual_seed(7)
    req = ce_request("a", gen, eng.model.vocab_size, [12])
    first = eng.forward([req])[0].outputs[0]["logprobs"]
    for _ in range(5):
        eng.forward_backward([req])
        eng.optim_step("a", AdamParams(learning_rate=5e-2))
    trained = eng.forward([req])[0].outputs[0]["logprobs"]
    eng.save("a", tmp_path / "a", optimizer=False)
    ref = make_engine(tiny_dir)  # fp32, from the saved masters
    ref.load("a", tmp_path / "a", optimizer=False)
    want = ref.forward([req])[0].outputs[0]["logprobs"]
    assert (trained - first).abs().max() > 0.5  # training moved it
    assert (trained - want).abs().max() < 0.25  # and bf16 follows the fp32 masters
