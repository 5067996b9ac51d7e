"""Checkpoints: PEFT export that peft loads, and exact resumption of training."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import ce_request, make_engine, randomize_b, weights

from twinkled.protocol.types import AdamParams, EngineInputError, ForwardBackwardRequest, LoraConfig

PARAMS = AdamParams(learning_rate=1e-2, weight_decay=0.01)


def _train(eng, name, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        eng.forward_backward([ce_request(name, gen, eng.model.vocab_size, [9, 13])])
        assert eng.optim_step(name, PARAMS).applied
    return gen


def test_resume_gives_the_same_weights_as_uninterrupted_training(tiny_dir, tmp_path):
    N, M = 3, 2
    straight = make_engine(tiny_dir)
    straight.add_adapter("a", LoraConfig(rank=4, seed=1))
    _train(straight, "a", N + M, seed=0)

    first = make_engine(tiny_dir)
    first.add_adapter("a", LoraConfig(rank=4, seed=1))
    gen = _train(first, "a", N, seed=0)
    size = first.save("a", tmp_path / "ckpt", optimizer=True)
    assert size > 0 and (tmp_path / "ckpt" / "optimizer.safetensors").is_file()
    rng_state = gen.get_state()

    fresh = make_engine(tiny_dir)  # a new process would see only the files
    info = fresh.load("resumed", tmp_path / "ckpt", optimizer=True)
    assert info.steps == N and info.rank == 4
    gen = torch.Generator()
    gen.set_state(rng_state)
    for _ in range(M):
        fresh.forward_backward([ce_request("resumed", gen, fresh.model.vocab_size, [9, 13])])
        fresh.optim_step("resumed", PARAMS)
    a, b = weights(straight, "a"), weights(fresh, "resumed")
    assert all(torch.allclose(a[k][i], b[k][i], atol=1e-6) for k in a for i in range(2))


def test_weights_only_load_resets_the_optimizer(tiny_dir, tmp_path):
    eng = make_engine(tiny_dir)
    eng.add_adapter("a", LoraConfig(rank=4, seed=1))
    _train(eng, "a", 2, seed=0)
    eng.save("a", tmp_path / "w", optimizer=False)
    assert not (tmp_path / "w" / "optimizer.safetensors").exists()
    info = eng.load("b", tmp_path / "w", optimizer=False)
    assert info.steps == 0
    b = eng.pool.get("b")
    assert all(t.abs().max() == 0 for t in b.bank.tensors(b.slot, "m"))
    with pytest.raises(EngineInputError, match="no optimizer state"):
        eng.load("c", tmp_path / "w", optimizer=True)
    assert not eng.has_adapter("c")


def test_exported_adapter_loads_in_peft_with_the_same_logits(tiny_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    eng = make_engine(tiny_dir)
    eng.add_adapter("a", LoraConfig(rank=8, alpha=16, seed=3))
    randomize_b(eng, "a", seed=4, std=0.2)  # so the adapter visibly changes the logits
    eng.save("a", tmp_path / "peft", optimizer=False)
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 8 and cfg["lora_alpha"] == 16

    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    ids = torch.randint(0, eng.model.vocab_size, (2, 15), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        peft_logits = PeftModel.from_pretrained(base, tmp_path / "peft")(input_ids=ids).logits
        from twinkled.engine.lora import LoraBatch

        a = eng.pool.get("a")
        lora = LoraBatch([a, a], eng.model.dtype, eng.model.device)
        dev = eng.model.device
        pos = torch.arange(15, device=dev).expand(2, -1)
        ours = eng.model.logits(eng.model.forward(ids.to(dev), pos, lora), lora).cpu()
    assert (peft_logits - plain).abs().max() > 1e-2  # the adapter matters
    assert (ours - peft_logits).abs().max() <= 1e-5


def test_peft_adapter_with_fewer_targets_loads(tiny_dir, tmp_path):
    """An adapter made by peft itself (q and v only) loads; missing modules stay zero."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    pm = get_peft_model(hf, PeftLoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for n, p in pm.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    pm.save_pretrained(tmp_path / "qv")
    eng = make_engine(tiny_dir)
    info = eng.load("qv", tmp_path / "qv", optimizer=False)
    assert info.rank == 4 and "q_proj" in info.target_modules
    ids = torch.randint(0, eng.model.vocab_size, (1, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = pm(input_ids=ids).logits
        from twinkled.engine.lora import LoraBatch

        lora = LoraBatch([eng.pool.get("qv")], eng.model.dtype, eng.model.device)
        dev = eng.model.device
        pos = torch.arange(9, device=dev)[None]
        got = eng.model.logits(eng.model.forward(ids.to(dev), pos, lora), lora).cpu()
    assert (got - want).abs().max() <= 1e-5


def test_bad_checkpoints_are_refused_and_change_nothing(tiny_dir, tmp_path):
    eng = make_engine(tiny_dir)
    eng.add_adapter("a", LoraConfig(rank=4, seed=1))
    eng.add_adapter("big", LoraConfig(rank=8, seed=2))
    eng.save("big", tmp_path / "r8")
    before = weights(eng, "a")
    with pytest.raises(EngineInputError, match="rank 8"):
        eng.load("a", tmp_path / "r8")  # shape mismatch with the existing adapter
    with pytest.raises(EngineInputError, match="holds no PEFT adapter"):
        eng.load("a", tmp_path / "nothing-here")
    (tmp_path / "r8" / "adapter_config.json").write_text(
        (tmp_path / "r8" / "adapter_config.json").read_text().replace('"r": 8', '"r": 4'))
    with pytest.raises(EngineInputError, match="expected lora_A"):
        eng.load("a", tmp_path / "r8")
    after = weights(eng, "a")
    assert all(torch.equal(before[k][i], after[k][i]) for k in before for i in range(2))


def test_save_replaces_atomically(tiny_dir, tmp_path):
    eng = make_engine(tiny_dir)
    eng.add_adapter("a", LoraConfig(rank=4, seed=1))
    eng.save("a", tmp_path / "ck")
    _train(eng, "a", 1, seed=0)
    eng.save("a", tmp_path / "ck")
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "ck"]
    assert leftovers == []
    assert eng.load("b", tmp_path / "ck").steps == 1


def _save_and_die(eng, path, at: int, exchange: bool) -> int:
    """Save in a forked child that dies (os._exit, no clean-up) just before its `at`-th
    file-system change; returns the child's exit code (0: it finished before that)."""
    import os
    import shutil

    from safetensors import torch as st_torch

    from twinkled.engine import state

    pid = os.fork()
    if pid:
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    try:
        calls = [0]

        def dies(fn):
            def wrapped(*a, **kw):
                if calls[0] == at:
                    os._exit(17)
                calls[0] += 1
                return fn(*a, **kw)
            return wrapped

        def no_exchange(a, b):
            raise OSError(22, "not supported here")

        state.save_file = dies(st_torch.save_file)
        state._exchange = dies(state._exchange if exchange else no_exchange)
        os.replace = dies(os.replace)
        shutil.rmtree = dies(shutil.rmtree)
        eng.save("a", path)
    finally:
        os._exit(0)


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "rename-aside"])
def test_a_crash_at_any_point_of_a_save_leaves_the_old_or_the_new(tiny_dir, tmp_path, exchange):
    """Whatever step of replacing a checkpoint the process dies before, the name holds a
    whole checkpoint, the old or the new one; and the next save still works."""
    eng = make_engine(tiny_dir)
    eng.add_adapter("a", LoraConfig(rank=4, seed=1))
    seen = set()
    for at in range(20):
        path = tmp_path / f"ck{at}"
        eng.save("a", path)  # the old one: steps = its count now
        old = eng.pool.get("a").steps
        _train(eng, "a", 1, seed=at)
        code = _save_and_die(eng, path, at, exchange)
        steps = eng.load("check", path).steps
        eng.remove_adapter("check")
        assert steps in (old, old + 1), (at, steps)
        seen.add(steps - old)
        eng.save("a", path)
        assert eng.load("check", path).steps == old + 1
        eng.remove_adapter("check")
        if code == 0:
            break
    assert code == 0 and seen == {0, 1}  # crashes fell both before and after the switch


def test_live_state_resumes_exactly_and_persister_keeps_the_newest(tiny_dir, tmp_path):
    """The workers' write-behind state: a restore continues training bit for bit."""
    from twinkled.workers.persist import Persister, latest_version

    straight = make_engine(tiny_dir)
    straight.add_adapter("a", LoraConfig(rank=4, alpha=8, seed=1, train_unembed=False))
    _train(straight, "a", 4, seed=0)

    first = make_engine(tiny_dir)
    first.add_adapter("a", LoraConfig(rank=4, alpha=8, seed=1, train_unembed=False))
    persister = Persister(tmp_path / "live")
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        first.forward_backward([ce_request("a", gen, first.model.vocab_size, [9, 13])])
        first.optim_step("a", PARAMS)
        persister.after_step("a", first.pool.get("a"))
        persister.pump(first.pool.adapters, {})
    assert persister.flush(first.pool.adapters, {})
    versions = [p for p in (tmp_path / "live" / "a").iterdir() if not p.name.startswith(".")]
    assert len(versions) == 1  # older versions go once a newer one is on disk

    fresh = make_engine(tiny_dir)
    info = fresh.load("a", latest_version(tmp_path / "live", "a"), optimizer=True)
    assert (info.steps, info.rank, info.alpha) == (2, 4, 8.0)
    assert "lm_head" not in info.target_modules
    for _ in range(2):
        fresh.forward_backward([ce_request("a", gen, fresh.model.vocab_size, [9, 13])])
        fresh.optim_step("a", PARAMS)
    a, b = weights(straight, "a"), weights(fresh, "a")
    assert all(torch.equal(a[k][i], b[k][i]) for k in a for i in range(2))

    persister.forget("a")
    assert persister.flush(fresh.pool.adapters, {})
    assert latest_version(tmp_path / "live", "a") is None


def test_the_persister_rests_between_writes_and_a_flush_does_not_wait(tiny_dir, tmp_path,
                                                                      monkeypatch):
    """The writer keeps the disk busy at most DUTY of the time: after a write it hands
    nothing new for three times as long (a large adapter's states written back to back
    stalled the journal's fsync behind them); a flush writes the newest state at once."""
    import time

    from twinkled.workers import persist
    from twinkled.workers.persist import Persister, latest_version

    eng = make_engine(tiny_dir)
    eng.add_adapter("a", LoraConfig(rank=4, alpha=8, seed=1, train_unembed=False))
    persister = Persister(tmp_path / "live")
    write = persist.write_live

    def slow_write(*args, **kwargs):  # a disk that takes 0.3 s a version
        time.sleep(0.3)
        return write(*args, **kwargs)

    monkeypatch.setattr(persist, "write_live", slow_write)
    gen = torch.Generator().manual_seed(0)

    def step() -> None:
        eng.forward_backward([ce_request("a", gen, eng.model.vocab_size, [9, 13])])
        eng.optim_step("a", PARAMS)
        persister.after_step("a", eng.pool.get("a"))
        persister.pump(eng.pool.adapters, {})

    step()
    deadline = time.monotonic() + 30
    while not persister.idle() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert persister.written == 1
    step()  # within the rest: nothing handed to the writer
    assert not persister.free() and persister.idle() and persister.written == 1
    assert persister.flush(eng.pool.adapters, {})  # the newest state, at once
    assert persister.written == 2
    info = make_engine(tiny_dir).load("a", latest_version(tmp_path / "live", "a"))
    assert info.steps == 2


def test_a_copied_adapter_has_the_weights_at_the_copy_and_nothing_else(tiny_dir, tmp_path):
    # What a sampler of a just-saved adapter is made of (runner: SaveF.sampler): the same
    # weights as the files of that save, none of the optimizer state, and independent of
    # the live adapter's later steps.
    eng = make_engine(tiny_dir)
    eng.add_adapter("a", LoraConfig(rank=4, seed=1))
    gen = _train(eng, "a", 2, seed=0)
    eng.save("a", tmp_path / "ckpt", optimizer=False)
    info = eng.copy_adapter("a", "copy")
    assert info.rank == 4 and info.steps == 2
    eng.load("read", tmp_path / "ckpt", optimizer=False)
    copy, read = weights(eng, "copy"), weights(eng, "read")
    assert all(torch.equal(copy[k][i], read[k][i]) for k in copy for i in range(2))
    c = eng.pool.get("copy")
    assert all(float(t.abs().sum()) == 0 for t in c.bank.tensors(c.slot, "m"))
    assert all(float(t.abs().sum()) == 0 for t in c.bank.tensors(c.slot, "g"))
    _train(eng, "a", 1, seed=5)
    later = weights(eng, "copy")
    assert all(torch.equal(copy[k][i], later[k][i]) for k in copy for i in range(2))
    assert not all(torch.equal(copy[k][0], weights(eng, "a")[k][0]) for k in copy)
    req = ce_request("copy", gen, eng.model.vocab_size, [7])
    same = ForwardBackwardRequest("read", req.data)
    lp = [r.outputs[0]["logprobs"] for r in eng.forward([req, same])]
    assert torch.allclose(lp[0], lp[1])
    with pytest.raises(EngineInputError):
        eng.copy_adapter("a", "copy")  # an id in use is refused, and changes nothing
    assert torch.equal(weights(eng, "copy")[next(iter(copy))][0], copy[next(iter(copy))][0])
