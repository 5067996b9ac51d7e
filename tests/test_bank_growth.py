"""A LoRA bank and the daemon's GPU budget for adapters (engine/lora_bank.py, core/
residency.py, workers/sampling.py): a growth that runs out of memory part-way leaves the
bank as it was, at its old capacity, and usable, or goes through host memory; `max_bytes`
(the budget, carried to the workers) stops a growth from overshooting it; a burst of
creates waits for room instead of growing the bank; samplers take only what the budget
leaves; and a wait for room ends cleanly when the daemon stops."""

from __future__ import annotations

import pytest
import torch

from twinkled.core.make_executor import worker_options
from twinkled.engine.lora_bank import Bank
from twinkled.protocol.config import Config
from twinkled.protocol.sizing import GiB
from twinkled.protocol.types import LoraConfig

TARGETS = {"q": (4, 6), "k": (4, 3), "up": (4, 8)}


def _bank(dtype=torch.float32, **kw) -> Bank:
    """A full bank of 4 slots, every kind of state random."""
    bank = Bank(2, TARGETS, "cpu", dtype, **kw)
    gen = torch.Generator().manual_seed(0)
    for _ in range(bank.capacity):
        slot = bank.allocate()
        for kind in bank.KINDS:
            bank.flat(slot, kind).copy_(torch.randn(bank.slot_numel, generator=gen))
        bank.changed(slot)
    bank.refresh()
    assert not bank.free
    return bank


def _state(bank: Bank) -> dict:
    return {(slot, kind): [t.clone() for t in bank.tensors(slot, kind)]
            for slot in range(bank.capacity) for kind in (*bank.KINDS, "w16")}


def _same(bank: Bank, state: dict) -> None:
    for (slot, kind), want in state.items():
        got = bank.tensors(slot, kind)
        assert len(got) == len(want)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), (slot, kind)
    for part, key, _, _ in bank._layout:  # the per-module stores too, at the capacity
        for kind in (*bank.KINDS, "w16"):
            store = bank._stores(kind)[0 if part == "A" else 1][key]
            assert store.shape[0] == bank.capacity
            assert torch.equal(store, bank.part(kind, part, key))
    assert all(f.shape[0] == bank.capacity for f in bank._flat.values())


def _fail_on(monkeypatch, owner, name: str, nth: set[int], when=lambda *a, **k: True):
    """`owner.name` raises out of memory at its calls numbered in `nth` (of those `when`
    picks)."""
    real, calls = getattr(owner, name), [0]

    def fake(*args, **kwargs):
        if when(*args, **kwargs):
            calls[0] += 1
            if calls[0] in nth:
                raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, fake)


def _grow_fails_then_works(monkeypatch, bank: Bank) -> None:
    state = _state(bank)
    with pytest.raises(torch.OutOfMemoryError) as failed:
        bank.allocate()
    monkeypatch.undo()
    assert bank.capacity == 4 and not bank.free
    _same(bank, state)
    slot = bank.allocate()  # grows now, keeping every old slot bit-exact
    assert bank.capacity == 8 and slot == 4
    _same(bank, state)
    assert f"from 4 to 8 slots of {bank.slot_bytes()} bytes" in str(failed.value)
    assert all(t.abs().sum() == 0 for kind in bank.KINDS for t in bank.tensors(slot, kind))


@pytest.mark.parametrize("parked", [False, True])
def test_growth_out_of_memory_at_a_kind_leaves_the_bank_as_it_was(monkeypatch, parked):
    bank = _bank()
    if parked:  # through host memory (a big bank on a full card): on a CPU, the same path
        monkeypatch.setattr(bank, "parks", lambda old, capacity: True)
    # the third kind's new buffer ("m") finds no room: "w" and "g" are grown already; a
    # growth on the card is tried again through host memory, whose "m" fails too
    _fail_on(monkeypatch, torch, "zeros", {3} if parked else {3, 6})
    _grow_fails_then_works(monkeypatch, bank)


def test_growth_out_of_memory_on_the_card_is_tried_through_host_memory(monkeypatch):
    # (on the card: free memory counted, but not in one piece)
    bank = _bank()
    state, through = _state(bank), []
    real = bank._grow_once
    monkeypatch.setattr(bank, "_grow_once", lambda c, host: through.append(host) or real(c, host))
    _fail_on(monkeypatch, torch, "zeros", {3})
    assert bank.allocate() == 4 and bank.capacity == 8
    assert through == [False, True]
    _same(bank, state)


def test_growth_out_of_memory_at_the_compute_copy(monkeypatch):
    # the copy fails at 8 slots on the card and again through host memory
    bank = _bank(torch.bfloat16)
    _fail_on(monkeypatch, torch.Tensor, "to", {1, 3},
             when=lambda self, *a, **k: torch.bfloat16 in a or k.get("dtype") == torch.bfloat16)
    _grow_fails_then_works(monkeypatch, bank)


def test_restore_goes_through_host_memory_when_the_card_is_full(monkeypatch):
    # the compute copy fails at 8 slots, then again at 4 beside the grown kinds: the kinds
    # are compacted through host memory and the copy made again (both tries)
    bank = _bank(torch.bfloat16)
    _fail_on(monkeypatch, torch.Tensor, "to", {1, 2, 4, 5},
             when=lambda self, *a, **k: torch.bfloat16 in a or k.get("dtype") == torch.bfloat16)
    _grow_fails_then_works(monkeypatch, bank)


def test_max_bytes_caps_growth():
    probe = Bank(2, TARGETS, "cpu")
    assert probe.slot_bytes() == 16 * probe.slot_numel
    assert Bank(2, TARGETS, "cpu", torch.bfloat16).slot_bytes() == 20 * probe.slot_numel
    n = 5  # doubling from 4 would give 8
    bank = Bank(2, TARGETS, "cpu", max_bytes=n * probe.slot_bytes() + 7)
    slots = [bank.allocate() for _ in range(n)]
    assert bank.capacity == n and sorted(slots) == list(range(n))
    assert bank.allocate() == n and bank.capacity == n + 1  # past the cap: one more slot
    small = Bank(2, TARGETS, "cpu", max_bytes=2 * probe.slot_bytes())
    assert small.capacity == 2  # the first growth is capped too
    assert Bank(2, TARGETS, "cpu", max_bytes=0).capacity == 1
    assert Bank(2, TARGETS, "cpu").capacity == 4  # no cap: as before


def test_adapter_budget_reaches_the_banks(tiny_dir, tmp_path):
    cfg = Config(model=tiny_dir, data_dir=tmp_path, device="cpu", dtype="float32")
    assert worker_options(cfg, ["cpu"])["bank_max_bytes"] is None
    assert worker_options(cfg, ["cpu"], 12345)["bank_max_bytes"] == 12345
    cfg = Config(model=tiny_dir, data_dir=tmp_path, device="cpu", dtype="float32",
                 adapter_memory_gb=0.5)
    assert worker_options(cfg, ["cpu"], 12345)["bank_max_bytes"] == GiB // 2
    from helpers import make_engine

    engine = make_engine(tiny_dir, bank_max_bytes=12345)
    engine.add_adapter("a", LoraConfig(rank=4, seed=1))
    (bank,) = engine.pool.banks.values()
    assert bank.max_bytes == 12345 and bank.capacity == 1


def test_a_burst_of_creates_past_the_budget_starts_runs_parked_not_a_bigger_bank(tiny_dir,
                                                                                 tmp_path):
    """3N creates at once with a GPU budget of N adapters: every one is answered at once
    (none refused, none waiting), those past the budget start parked on disk without a park
    of anyone, each comes in on its first request, and the worker's bank never grows past
    the budget (creates had held their room at once and parked behind: 64 clients creating
    1,000 runs grew a 0.5B bank past an H200's memory; then waited ~4 a second for parks)."""
    import asyncio

    from test_residency_tiers import _op
    from test_service import done, run, service

    from twinkled.protocol.sizing import adapter_bytes

    n = 2
    one = adapter_bytes(Config(model=tiny_dir).model_config, 4)

    async def burst():
        async with service(tiny_dir, tmp_path, adapter_memory_gb=(n + 0.5) * one / GiB,
                           host_adapter_memory_gb=4 * one / GiB) as box:
            futures, models = [], []
            for i in range(3 * n):
                tenant = f"t{i}"
                box.store.tenants.ensure(tenant)
                session = box.store.sessions.create(tenant)
                model, f = box.svc.create_model(
                    tenant, session, None, LoraConfig(rank=4, alpha=8.0, seed=i), {},
                    lambda model: (b"{}", "application/json"))
                futures.append(f)
                models.append(model)
            await asyncio.gather(*(done(f) for f in futures))
            assert [f.error for f in futures] == [None] * (3 * n)
            residency = box.svc.lanes.all[0].residency
            status = residency.tiers.status()
            assert residency.count() == n and status["started_parked"] == 2 * n, status
            assert sum(status["moves"].values()) == 0  # nobody parked for them
            for i, model in enumerate(models):  # each trains, brought in as it comes
                await _op(box, f"t{i}", model,
                          lambda i=i, m=model: box.fwdbwd(f"t{i}", m, 1, [5, 7]))
            assert residency.count() <= n
            runner = box.svc.lanes.all[0].executor.group._runner
            (bank,) = runner.engine.pool.banks.values()
            assert bank.max_bytes == int((n + 0.5) * one)
            assert bank.capacity <= bank.max_bytes // bank.slot_bytes(), bank.capacity

    run(burst())


def test_a_park_on_a_full_card_copies_view_by_view(tiny_dir, monkeypatch):
    """On a GPU (TWINKLE_TEST_DEVICE=cuda): where the card has no room for a parked
    adapter's flat copy (its snapshot's cat, its way back in), the park and the unpark go
    view by view through host memory, bit for bit (the 1,000-run bench: a park failed for
    want of 202 MiB beside a full bank)."""
    from helpers import DEVICE, adapter_snapshot, ce_request, make_engine

    from twinkled.protocol.types import AdamParams
    from twinkled.workers.parked import HostTier

    if DEVICE != "cuda":
        pytest.skip("the device copies of a park: CUDA")
    engine = make_engine(tiny_dir)
    vocab, gen = engine.model.vocab_size, torch.Generator().manual_seed(0)
    engine.add_adapter("a", LoraConfig(rank=4, seed=1))
    engine.forward_backward([ce_request("a", gen, vocab, [5, 7])])
    engine.optim_step("a", AdamParams(learning_rate=1e-2))
    before = adapter_snapshot(engine, "a")
    real_cat, real_empty = torch.cat, torch.empty

    def cat(ts, *a, **k):
        if ts and ts[0].is_cuda:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return real_cat(ts, *a, **k)

    def empty(*a, device=None, **k):
        if device is not None and torch.device(device).type == "cuda":
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return real_empty(*a, device=device, **k)

    monkeypatch.setattr(torch, "cat", cat)
    monkeypatch.setattr(torch, "empty", empty)
    tier = HostTier(engine)
    tier.park("a")
    tier.unpark("a")
    monkeypatch.undo()
    after = adapter_snapshot(engine, "a")
    assert all(before[k].equal(after[k]) for k in before)


def test_samplers_take_only_what_the_budget_leaves_of_a_bank(tiny_dir, tmp_path):
    """The daemon's budget counts training adapters; samplers take what it leaves. A bank
    that holds all of the budget makes room by parking its least recently used idle
    sampler to host memory (SampleRunner.give_room), for a training adapter and for another
    sampler alike, rather than grow past the budget; a parked sampler's next sample brings
    it back and draws the same tokens."""
    from helpers import make_engine

    from twinkled.protocol.frames import CreateF, SampleF, SamplingF, StepF, buf
    from twinkled.workers.runner import StepRunner

    probe = make_engine(tiny_dir)
    for seed in (7, 8):
        probe.add_adapter(f"src{seed}", LoraConfig(rank=4, seed=seed))
        probe.save(f"src{seed}", tmp_path / f"sampler{seed}")
    slot = probe.pool.bank_of("src7").slot_bytes()
    engine = make_engine(tiny_dir, bank_max_bytes=2 * slot)
    runner = StepRunner(engine, 0, 1, None)

    def create(name: str, seed: int) -> None:
        [out] = runner.run(StepF(seed, "barrier", [CreateF(name, LoraConfig(rank=4, seed=seed))]))
        assert out.error is None, out.error

    def tokens(sampler: str, seed: int) -> list[int]:
        f = SampleF(sampler, buf([3, 1, 4], "int64"), SamplingF(8, 0.0, -1, 1.0, None, []),
                    load_from=str(tmp_path / f"sampler{seed}"))
        f.key = sampler
        [out] = runner.run(StepF(0, "sample", [f], 0.0))
        assert out.error is None, out.error
        return out.sample.sequences[0].tokens

    create("t1", 1)
    first = tokens("s7", 7)
    bank = engine.pool.bank_of("t1")
    assert bank.capacity == 2 and not bank.free and engine.has_adapter("s7")
    other = tokens("s8", 8)  # s7 makes room for s8
    assert bank.capacity == 2 and not engine.has_adapter("s7") and "s7" in runner.sampling.parked
    assert tokens("s7", 7) == first and "s8" in runner.sampling.parked  # and back
    create("t2", 2)  # a training adapter: s7 leaves; the bank stays at the budget
    assert bank.capacity == 2 and not engine.has_adapter("s7")
    assert engine.has_adapter("t1") and engine.has_adapter("t2")
    assert tokens("s8", 8) == other  # past the budget now: samplers are not budgeted
    assert engine.has_adapter("s8") and bank.capacity == 3


def test_a_create_the_bank_has_no_room_for_is_answered_at_once_holding_none(tiny_dir,
                                                                             tmp_path):
    """A create while the bank's one adapter cannot be parked (its run has work queued that
    cannot run) is answered at once: the new run starts parked, holding no room, and the
    daemon still stops cleanly (its first request would wait for room: the next test)."""
    import asyncio

    from test_service import run, service

    from twinkled.protocol.sizing import adapter_bytes

    one = adapter_bytes(Config(model=tiny_dir).model_config, 4)

    async def go():
        async with service(tiny_dir, tmp_path, adapter_memory_gb=1.5 * one / GiB,
                           drain_timeout_s=0.5) as box:
            busy = await box.create("t0", seed=1)
            box.fwdbwd("t0", busy, 5, [4])  # op 5 waits for ops 1-4: queued work, for good
            box.store.tenants.ensure("t1")
            session = box.store.sessions.create("t1")
            model, f = box.svc.create_model("t1", session, None, LoraConfig(rank=4, seed=2),
                                            {}, lambda model: (b"{}", "application/json"))
            await asyncio.wait_for(f.done.wait(), 5)
            assert f.error is None
            residency = box.svc.lanes.all[0].residency
            assert residency.count() == 1 and not residency.is_open(model)
            assert residency.room.used() == residency.room.held(busy)
            row = box.store.runs.get(model)
            assert row["idle_unloaded"] and not row["live"] and row["next_seq"] == 1
            await box.svc.life.shutdown()
            assert all(t.done() for t in residency._waiting)

    run(go())


def test_a_bring_in_waiting_for_room_ends_when_the_daemon_stops(tiny_dir, tmp_path):
    """A request for a parked run that waits for room (the one resident run has work queued
    that cannot run) hears "again" (Draining: a 503 the client retries) when the daemon
    stops, and the stop goes on to persist every run (it had waited for that request's
    hold on the bank for good)."""
    import asyncio

    from test_service import run, service

    from twinkled.protocol.errors import Draining
    from twinkled.protocol.sizing import adapter_bytes

    one = adapter_bytes(Config(model=tiny_dir).model_config, 4)

    async def go():
        async with service(tiny_dir, tmp_path, adapter_memory_gb=1.5 * one / GiB,
                           drain_timeout_s=0.5) as box:
            parked = await box.create("t0", seed=1)
            busy = await box.create("t1", seed=2)  # parks t0's run to make room
            residency = box.svc.lanes.all[0].residency
            assert not residency.is_open(parked)
            box.fwdbwd("t1", busy, 5, [4])  # op 5 waits for ops 1-4: queued work, for good
            bring = asyncio.ensure_future(box.svc.ensure_loaded(box.store.runs.get(parked)))
            await asyncio.sleep(0.3)
            assert not bring.done()  # waiting for room
            await asyncio.wait_for(box.svc.life.shutdown(), 30)
            with pytest.raises(Draining, match="submit it again"):
                await bring

    run(go())


def test_a_fresh_sampler_copy_is_the_first_to_give_its_slot(tiny_dir, tmp_path):
    """A save for sampling keeps a device copy of the weights in the bank (its first sample
    reads no files). At the budget, that copy is the first to go (its files will do): the
    next training adapter takes its slot, and a sample from the save still draws what the
    copy would have (from the files)."""
    from helpers import make_engine

    from twinkled.protocol.frames import CreateF, SampleF, SamplingF, SaveF, StepF, buf
    from twinkled.protocol.types import SampleRequest, SamplingParams
    from twinkled.workers.runner import StepRunner

    probe = make_engine(tiny_dir)
    probe.add_adapter("src", LoraConfig(rank=4, seed=7))
    slot = probe.pool.bank_of("src").slot_bytes()
    engine = make_engine(tiny_dir, bank_max_bytes=2 * slot)
    runner = StepRunner(engine, 0, 1, None)

    def run(step: StepF):
        [out] = runner.run(step)
        assert out.error is None, out.error
        return out

    run(StepF(1, "barrier", [CreateF("t1", LoraConfig(rank=4, seed=1))]))
    run(StepF(2, "barrier", [SaveF("t1", str(tmp_path / "s1"), sampler=True)]))
    bank = engine.pool.bank_of("t1")
    assert len(runner.sampling.fresh) == 1 and bank.capacity == 2 and not bank.free
    run(StepF(3, "barrier", [CreateF("t2", LoraConfig(rank=4, seed=2))]))
    assert not runner.sampling.fresh and bank.capacity == 2  # the copy went, not the budget
    f = SampleF("s1", buf([3, 1, 4], "int64"), SamplingF(8, 0.0, -1, 1.0, None, []),
                load_from=str(tmp_path / "s1"))
    f.key = "s1"
    got = run(StepF(4, "sample", [f], 0.0)).sample.sequences[0].tokens
    probe.load("want", tmp_path / "s1", optimizer=False)
    want = probe.sample([SampleRequest("want", [3, 1, 4], SamplingParams(8, 0.0))])
    assert len(got) == 8 and got == want[0].sequences[0].tokens


def test_a_create_draws_its_seed_at_the_door_and_writes_nothing(tiny_dir, tmp_path):
    """An unseeded create gets its seed from the daemon, kept in the run's config, so its
    initial weights follow from the store (a restore before its first persisted state makes
    them again: tests/test_durability.py) and a create writes no state: 1,000 creates of
    the 0.5B wrote 211 GB, most of a GPU machine's disk. Training then persists as ever."""
    import asyncio
    import time

    from test_service import done, run, service

    async def go():
        async with service(tiny_dir, tmp_path) as box:
            box.store.tenants.ensure("t0")
            session = box.store.sessions.create("t0")
            model, f = box.svc.create_model("t0", session, None, LoraConfig(rank=4), {},
                                            lambda model: (b"{}", "application/json"))
            await done(f)
            assert f.error is None, f.error
            assert isinstance(box.store.runs.get(model)["lora_config"]["seed"], int)
            other = await box.create("t1", seed=3)
            for seq in (1, 2):  # steps of another run: the writer's turns between them
                await done(box.fwdbwd("t1", other, seq, [5], forward_only=True))
            live = tmp_path / "live" / model
            assert not live.exists() or not any(live.iterdir())
            await done(box.fwdbwd("t0", model, 1, [5]))
            await done(box.optim("t0", model, 2))
            deadline = time.monotonic() + 10  # (written behind the step)
            while not (live.exists() and any(live.iterdir())) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert live.exists() and any(live.iterdir())  # trained: persisted

    run(go())
