"""The LoRA pool and mixed-adapter batches: one pass, every adapter's exact gradients."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from helpers import ce_request, grads, make_engine, max_diff, randomize_b

from twinkled.protocol.types import EngineInputError, ForwardBackwardRequest, LoraConfig


def test_add_and_remove_adapters(engine):
    info = engine.add_adapter("t1", LoraConfig(rank=8, alpha=16, seed=1, train_unembed=False))
    assert (info.rank, info.alpha) == (8, 16)
    assert "lm_head" not in info.target_modules and "q_proj" in info.target_modules
    engine.add_adapter("t2", LoraConfig(rank=8, seed=2, train_mlp=False))
    with pytest.raises(EngineInputError, match="already exists"):
        engine.add_adapter("t1")
    engine.remove_adapter("t1")
    assert not engine.has_adapter("t1")
    with pytest.raises(EngineInputError, match="no adapter 't1'"):
        engine.optim_step("t1")
    with pytest.raises(EngineInputError, match="no adapter"):
        engine.remove_adapter("t1")


def test_rank_limits(tiny_dir):
    eng = make_engine(tiny_dir, max_rank=16)
    for bad in (17, -3):  # (rank 0 is a full-parameter run: test_full_param.py)
        with pytest.raises(EngineInputError, match="rank"):
            eng.add_adapter(f"r{bad}", LoraConfig(rank=bad))
    with pytest.raises(EngineInputError, match="at least one"):
        eng.add_adapter("none", LoraConfig(rank=4, train_attn=False, train_mlp=False, train_unembed=False))
    eng.add_adapter("r1", LoraConfig(rank=1))
    eng.add_adapter("r16", LoraConfig(rank=16))


def test_seed_makes_adapters_reproducible(engine):
    engine.add_adapter("x", LoraConfig(rank=4, seed=7))
    engine.add_adapter("y", LoraConfig(rank=4, seed=7))
    engine.add_adapter("z", LoraConfig(rank=4, seed=8))
    from helpers import weights

    assert max_diff(weights(engine, "x"), weights(engine, "y")) == 0
    assert max_diff(weights(engine, "x"), weights(engine, "z")) > 0


def test_removing_adapters_frees_their_memory(engine):
    engine.add_adapter("a", LoraConfig(rank=8, seed=1))
    bank = engine.pool.get("a").bank
    ref = weakref.ref(bank.A["lm_head"])
    engine.add_adapter("b", LoraConfig(rank=8, seed=2))
    engine.remove_adapter("a")
    # The slot is zeroed and reused; a bank is dropped with its last adapter.
    assert bank.free and ref() is not None
    engine.remove_adapter("b")
    del bank
    gc.collect()
    assert ref() is None
    assert engine.pool.banks == {}


def test_slots_grow_and_are_reused(engine):
    ids = [f"t{i}" for i in range(9)]  # more than a bank's first capacity
    for i, name in enumerate(ids):
        engine.add_adapter(name, LoraConfig(rank=4, seed=i))
    assert len(engine.pool.banks) == 1 and len({engine.pool.get(n).slot for n in ids}) == 9
    slot = engine.pool.get("t3").slot
    engine.remove_adapter("t3")
    engine.add_adapter("new", LoraConfig(rank=4, seed=99))
    assert engine.pool.get("new").slot == slot
    # Growth kept the other adapters' weights: same as a fresh adapter with that seed.
    engine.add_adapter("check", LoraConfig(rank=4, seed=0))
    from helpers import weights

    assert max_diff(weights(engine, "t0"), weights(engine, "check")) == 0


@pytest.mark.parametrize("big,parks", [(False, False), (True, False), (True, True)])
def test_growth_keeps_weights_and_moments(engine, monkeypatch, big, parks):
    """Growing a bank keeps every adapter's weights and optimizer moments: a small bank
    doubling, a big one growing by a quarter on its card (a kind at a time), and a big one
    whose card has no room for that, parking its rows in host memory while it grows."""
    from twinkled.engine.lora import Bank

    monkeypatch.setattr(Bank, "big", lambda self, slots: big)
    monkeypatch.setattr(Bank, "parks", lambda self, old, capacity: parks)
    engine.add_adapter("t0", LoraConfig(rank=4, seed=0))
    bank = engine.pool.get("t0").bank
    before = {k: bank.flat(0, k).clone() for k in ("w", "m", "v")}
    before["m"].normal_(), before["v"].uniform_()
    bank.flat(0, "m").copy_(before["m"]), bank.flat(0, "v").copy_(before["v"])
    for i in range(1, 9):  # past the first capacity of 4, then 8
        engine.add_adapter(f"t{i}", LoraConfig(rank=4, seed=i))
    assert bank.capacity == (12 if big else 16)  # a big bank grows by a quarter (min 4)
    for k, v in before.items():
        assert torch.equal(bank.flat(0, k), v), k
    key = next(iter(bank.shapes))
    assert bank.A[key].data_ptr() == bank.flat(0, "w").data_ptr()  # views into the new rows


def _mixed_setup(tiny_dir):
    eng = make_engine(tiny_dir)
    configs = {
        "a": LoraConfig(rank=8, alpha=16, seed=1),
        "b": LoraConfig(rank=4, alpha=8, seed=2, train_unembed=False),
        "c": LoraConfig(rank=8, alpha=8, seed=3),  # same bank as "a"
        "d": LoraConfig(rank=8, seed=4, train_attn=False),  # MLP + unembed only
    }
    for i, (name, cfg) in enumerate(configs.items()):
        eng.add_adapter(name, cfg)
        randomize_b(eng, name, seed=10 + i)
    return eng


def _requests(vocab):
    gen = torch.Generator().manual_seed(0)
    return [
        ce_request("a", gen, vocab, [9, 17]),
        ce_request("b", gen, vocab, [13]),
        ce_request(None, gen, vocab, [21], forward_only=True),  # base-model logprobs
        ce_request("c", gen, vocab, [5, 11, 8]),
        ce_request("d", gen, vocab, [16]),
        ce_request("a", gen, vocab, [6]),  # a second request of "a" in the same pass
    ]


def test_mixed_batch_gradients_equal_training_alone(tiny_dir):
    mixed = _mixed_setup(tiny_dir)
    vocab = mixed.model.vocab_size
    reqs = _requests(vocab)
    out_mixed = mixed.forward_backward(reqs)
    for name in "abcd":
        alone = _mixed_setup(tiny_dir)
        mine = [r for r in _requests(vocab) if r.adapter_id == name]
        out_alone = alone.forward_backward(mine)
        assert max_diff(grads(mixed, name), grads(alone, name)) <= 1e-5, name
        g = grads(alone, name)
        assert max(t.abs().max().item() for pair in g.values() for t in pair) > 0
        got = [o for r, o in zip(reqs, out_mixed, strict=True) if r.adapter_id == name]
        for x, y in zip(got, out_alone, strict=True):
            assert x.metrics["loss:sum"] == pytest.approx(y.metrics["loss:sum"], abs=1e-4)
    # The base-model rows equal a base-only forward.
    base = make_engine(tiny_dir).forward([r for r in _requests(vocab) if r.adapter_id is None])
    got = out_mixed[2].outputs[0]["logprobs"]
    assert torch.allclose(got, base[0].outputs[0]["logprobs"], atol=1e-5)


def test_one_pass_for_many_adapters(tiny_dir, monkeypatch):
    """The base model runs once per micro-batch, not once per adapter."""
    eng = _mixed_setup(tiny_dir)
    calls = []
    original = eng.model.forward
    monkeypatch.setattr(eng.model, "forward", lambda *a, **k: calls.append(1) or original(*a, **k))
    eng.forward_backward(_requests(eng.model.vocab_size))
    assert len(calls) == 1


def test_gradients_match_peft_autograd(tiny_dir):
    """Our hand-written LoRA backward against peft's autograd on the same weights."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    eng = make_engine(tiny_dir)
    eng.add_adapter("a", LoraConfig(rank=4, alpha=8, seed=5))
    randomize_b(eng, "a", seed=6)
    gen = torch.Generator().manual_seed(1)
    req = ce_request("a", gen, eng.model.vocab_size, [12])
    eng.forward_backward([req])
    ours = grads(eng, "a")

    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    targets = list(LoraConfig().target_modules)
    peft_model = get_peft_model(hf, PeftLoraConfig(r=4, lora_alpha=8, target_modules=targets))
    a = eng.pool.get("a")
    params = dict(peft_model.named_parameters())
    for key in a.bank.shapes:
        params[f"base_model.model.{key}.lora_A.default.weight"].data.copy_(a.bank.A[key][a.slot])
        params[f"base_model.model.{key}.lora_B.default.weight"].data.copy_(a.bank.B[key][a.slot])
    d = req.data[0]
    logits = peft_model(input_ids=torch.as_tensor(d.tokens)[None]).logits[0]
    lp = torch.log_softmax(logits.float(), -1).gather(1, d.loss_inputs["target_tokens"][:, None])
    (-lp.sum()).backward()
    for key in a.bank.shapes:
        ga = params[f"base_model.model.{key}.lora_A.default.weight"].grad
        gb = params[f"base_model.model.{key}.lora_B.default.weight"].grad
        assert torch.allclose(ours[key][0], ga, atol=1e-5), key
        assert torch.allclose(ours[key][1], gb, atol=1e-5), key


def test_base_model_cannot_be_trained(engine):
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(EngineInputError, match="base model cannot be trained"):
        engine.forward_backward([ForwardBackwardRequest(None, ce_request(None, gen, 100, [4]).data)])
