"""Tiered adapter residency (core/tiers.py): with a GPU bank that holds N adapters and host
memory for N more, 3N runs train round-robin, parked to host memory and to disk and
brought back between their requests, to exactly the weights each reaches alone; none is
refused; and after a restart the runs parked on disk go on at their step.

Driven in-process (test_service.py's `service`: the same frames on the same StepRunner as
a worker process), on the tiny model, as the routes do: `ensure_loaded`, then the op.
"""

from __future__ import annotations

import pytest
from test_service import done, logprobs, result, run, service

from twinkled.core.adapter_room import AdapterRoom
from twinkled.core.tiers import CHURN_WARN
from twinkled.protocol.config import Config
from twinkled.protocol.sizing import GiB, adapter_bytes

N = 2  # adapters the GPU bank holds (and host memory holds)
RUNS = 3 * N


async def _op(box, tenant: str, model: str, make):
    """One request for `model`, as a route sends it: its adapter brought in first."""
    await box.svc.ensure_loaded(box.store.runs.get(model))
    f = make()
    await done(f)
    assert f.error is None, f.error
    return f


async def _train(box, runs: list[str], seq: int, rounds: int) -> int:
    """`rounds` round-robin: a forward_backward of every run, then an optim_step of every
    run in the reverse order (so each is parked with its gradients pending and comes back to
    step them, the last ones from host memory, the first ones from disk)."""
    for r in range(rounds):
        for i, m in enumerate(runs):
            await _op(box, f"t{i}", m, lambda i=i, m=m, s=seq, r=r: box.fwdbwd(
                f"t{i}", m, s, [5, 7], seed=10 * r + i))
        for i, m in reversed(list(enumerate(runs))):
            await _op(box, f"t{i}", m, lambda i=i, m=m, s=seq: box.optim(f"t{i}", m, s + 1))
        seq += 2
    return seq


async def _scores(box, runs: list[str], seq: int, tenants: list[str] | None = None) -> list:
    out = []
    for i, m in enumerate(runs):
        t = tenants[i] if tenants else f"t{i}"
        f = await _op(box, t, m, lambda t=t, m=m: box.fwdbwd(
            t, m, seq, [6], seed=99, forward_only=True))
        out.append(logprobs(result(f)))
    return out


async def _create(box, n: int) -> list[str]:
    return [await box.create(f"t{i}", seed=100 + i) for i in range(n)]


def test_3n_runs_train_round_robin_through_host_and_disk_to_the_weights_alone(tiny_dir,
                                                                             tmp_path, caplog):
    one = adapter_bytes(Config(model=tiny_dir).model_config, 4)
    tiers = {"adapter_memory_gb": (N + 0.5) * one / GiB,
             "host_adapter_memory_gb": (N + 0.2) * one * 16 / 20 / GiB}

    async def reference():
        async with service(tiny_dir, tmp_path / "alone") as box:  # room for every run
            runs = await _create(box, RUNS)
            seq = await _train(box, runs, 1, 2)
            first = await _scores(box, runs, seq)
            seq = await _train(box, runs, seq + 1, 1)
            second = await _scores(box, runs, seq)
            seq = await _train(box, runs, seq + 1, 1)
            return first, second, await _scores(box, runs, seq)

    async def tiered():
        async with service(tiny_dir, tmp_path / "tiers", **tiers) as box:
            runs = await _create(box, RUNS)  # none refused
            seq = await _train(box, runs, 1, 2)
            first = await _scores(box, runs, seq)
            residency = box.svc.lanes.all[0].residency
            status = residency.tiers.status()
            assert residency.count() <= N and status["host"] <= N
            for move in ("to_host", "to_disk", "from_host", "from_disk"):
                assert status["moves"].get(move, 0) > 0, status
            # 3N runs taking turns in a bank of N: each park is of a run that just trained,
            # and the operator is told what to change
            assert status["churn"] >= CHURN_WARN, status
            assert any("the GPU bank is too small for the runs training now" in r.message
                       and "adapter_memory_gb" in r.message for r in caplog.records
                       if r.levelname == "WARNING")
            # The worker group restarts while N runs are parked in its host memory: they
            # come back from disk (persisted state, then the journal), at their step.
            assert status["host"] == N
            await box.svc.lanes.all[0].executor.recover("a worker was lost")
            assert residency.tiers.status()["host"] == 0
            seq = await _train(box, runs, seq + 1, 1)
            second = await _scores(box, runs, seq)
        # The daemon restarts, with room for one run: of the N live at the stop, one comes
        # back at start-up and the other stays on disk; every run goes on at its step.
        async with service(tiny_dir, tmp_path / "tiers",
                           **{**tiers, "adapter_memory_gb": 1.5 * one / GiB}) as box:
            assert box.svc.lanes.all[0].residency.count() == 1
            seq = await _train(box, runs, seq + 1, 1)
            return first, second, await _scores(box, runs, seq)

    alone = run(reference())
    tiered_ = run(tiered())
    # Each run at the weights it reaches alone. The moves copy the state bit for bit
    # (test_a_parked_adapter_comes_back_bit_for_bit), but a run back in another bank slot,
    # or replayed from the journal, may round a matmul differently (seen: 4e-6 on CPU,
    # under load): fp32 tolerance, far below what one step changes (~0.1 here).
    for phase, got in zip(alone, tiered_, strict=True):
        for want, have in zip(phase, got, strict=True):
            for x, y in zip(want, have, strict=True):
                assert y == pytest.approx(x, abs=1e-4)


def test_parks_of_recently_used_adapters_are_churn_and_warned_of_once(monkeypatch):
    """A park counts as churn only if its adapter ran or was asked for within CHURN_RECENT_S;
    CHURN_WARN of them within CHURN_WINDOW_S warn, then not again for CHURN_QUIET_S."""
    import twinkled.core.tiers as tiers_mod

    now = [1000.0]
    monkeypatch.setattr(tiers_mod.time, "monotonic", lambda: now[0])
    tiers = tiers_mod.Tiers(AdapterRoom(None, lambda c: 1), AdapterRoom(8, lambda c: 1))
    tiers.touch("idle")
    now[0] += tiers_mod.CHURN_RECENT_S + 1
    assert not tiers.parked("idle") and tiers.churn == 0  # an idle run parked: as it should
    warned = []
    for i in range(2 * tiers_mod.CHURN_WARN):
        tiers.touch(f"m{i}")
        now[0] += 1
        warned.append(tiers.parked(f"m{i}"))
    assert tiers.churn == 2 * tiers_mod.CHURN_WARN
    assert warned.index(True) == tiers_mod.CHURN_WARN - 1 and warned.count(True) == 1
    now[0] += tiers_mod.CHURN_QUIET_S
    tiers.touch("again")
    assert not tiers.parked("again")  # (the window is empty again: one is not churn enough)
    text = tiers.churn_warning(resident=3)
    assert "holds 3" in text and "no limit" in text and "token_budget" in text


def test_an_adapter_larger_than_the_whole_gpu_budget_is_refused_with_the_numbers(tiny_dir,
                                                                                 tmp_path):
    from twinkled.core.adapter_room import NoRoom

    one = adapter_bytes(Config(model=tiny_dir).model_config, 4)

    async def go():
        async with service(tiny_dir, tmp_path, adapter_memory_gb=0.5 * one / GiB) as box:
            with pytest.raises(NoRoom, match="adapter_memory_gb"):
                await box.create("alice")
            assert box.store.runs.list("alice")[1] == 0  # no run row was left behind

    run(go())


@pytest.mark.parametrize("key", ["adapter_memory_gb", "host_adapter_memory_gb"])
def test_a_negative_budget_is_a_clear_config_error(key, tmp_path):
    from twinkled.protocol.config import check_config

    assert Config(**{key: -1.0}).range_problems() == [f"{key}: must be 0 or more, got -1.0"]
    path = tmp_path / "twinkled.toml"
    path.write_text(f"{key} = -2\n")
    assert check_config(path) == [f"{key}: must be 0 or more, got -2"]


def test_tinker_clients_beyond_the_gpu_budget_train_in_a_daemon(tiny_dir, tmp_path):
    """A daemon whose GPU bank and host memory hold one adapter each: three tinker clients
    train in turn, none refused, and each scores the same after it was parked to host memory
    or to disk (worker processes: the moves' frames cross ZeroMQ) as right after its step."""
    import tinker
    from daemon import Daemon, ctl_status, make_key, run_ctl
    from test_workers import T, _data, _logprobs, _step

    one = adapter_bytes(Config(model=tiny_dir).model_config, 4)
    cfg = tmp_path / "twinkled.toml"
    cfg.write_text(f"adapter_memory_gb = {1.5 * one / GiB}\n"
                   f"host_adapter_memory_gb = {1.5 * one * 12 / 20 / GiB}\n")
    key = make_key(tmp_path, "ida")
    d = Daemon(tiny_dir, tmp_path, tmp_path / "log", "--config", str(cfg))
    try:
        sc = tinker.ServiceClient(base_url=d.url, api_key=key)
        clients = [sc.create_lora_training_client(base_model=tiny_dir.name, rank=4,
                                                  seed=s).result(timeout=T) for s in (1, 2, 3)]
        data = _data(clients[0].get_tokenizer())
        want = []
        for tc in clients:
            _step(tc, data)
            want.append(_logprobs(tc, data))
        # the last one is resident, the one before in host memory, the first on disk
        assert [_logprobs(tc, data) for tc in reversed(clients)] == want[::-1]
        tiers = ctl_status(tmp_path)["tiers"]
        assert tiers["gpu"] == 1 and tiers["host"] == 1
        assert all(tiers["moves"].get(k) for k in ("to_host", "to_disk", "from_host",
                                                   "from_disk")), tiers
        # each was parked seconds after its step: churn, in ctl status and in /metrics
        import urllib.request

        assert tiers["churn"] >= 2, tiers
        with urllib.request.urlopen(f"{d.url}/metrics", timeout=T) as r:
            metrics = r.read().decode()
        assert f"twinkle_adapter_churn_total {float(tiers['churn'])}" in metrics
        # the second and third were created with the bank full: started parked, made on
        # their first step (no park for a create)
        assert tiers["started_parked"] == 2, tiers
        assert "twinkle_runs_started_parked_total 2.0" in metrics
        text = run_ctl(tmp_path, "status").stdout  # and what an operator reads
        moves = tiers["moves"]
        assert (f"adapters: 1 in GPU banks, 1 in host memory; moves to host "
                f"{moves['to_host']}, to disk {moves['to_disk']}, back from host "
                f"{moves['from_host']}, from disk {moves['from_disk']}") in text, text
        assert "new runs started parked 2" in text, text
        prefetch = tiers["prefetch"]  # the labels reference.md documents
        assert (f'twinkle_adapter_prefetch_total{{result="hit"}} {float(prefetch["hits"])}'
                in metrics and f'twinkle_adapter_prefetch_total{{result="miss"}} '
                f'{float(prefetch["misses"])}' in metrics), metrics
        for tc in clients:  # and they train on
            _step(tc, data)
        sc.close("success").result(timeout=T)
    finally:
        d.stop()


def test_an_evicted_sampler_is_parked_in_host_memory_and_samples_alike(tiny_dir, tmp_path,
                                                                        monkeypatch):
    """A rank's samplers beyond SAMPLER_ADAPTERS leave the bank for host memory (weights
    only), not for nothing: the next sample from one brings it back bit for bit, without
    its files (removed here), and draws the same greedy tokens."""
    import shutil

    from helpers import make_engine

    from twinkled.protocol.frames import SampleF, SamplingF, StepF, buf
    from twinkled.protocol.types import LoraConfig
    from twinkled.workers import sampling

    monkeypatch.setattr(sampling, "SAMPLER_ADAPTERS", 1)
    engine = make_engine(tiny_dir)
    for i, name in enumerate(("one", "two")):
        engine.add_adapter(name, LoraConfig(rank=4, seed=i))
        engine.save(name, tmp_path / name)
    runner = sampling.SampleRunner(engine, 0, 0, 1, True, False, None)

    def tokens(adapter: str, path: str) -> list[int]:
        f = SampleF(adapter, buf([3, 1, 4], "int64"),
                    SamplingF(8, 0.0, -1, 1.0, None, []), load_from=str(tmp_path / path))
        f.key = adapter
        [out] = runner.run(StepF(0, "sample", [f], 0.0))
        return out.sample.sequences[0].tokens

    first = tokens("s1", "one")
    weights = [t.clone() for t in engine.pool.get("s1").bank.tensors(
        engine.pool.get("s1").slot, "w")]
    tokens("s2", "two")  # s1 is evicted: to host memory
    assert not engine.has_adapter("s1") and "s1" in runner.parked
    shutil.rmtree(tmp_path / "one")  # so the files cannot be what brings it back
    assert tokens("s1", "one") == first
    back = engine.pool.get("s1")
    assert all(a.equal(b) for a, b in zip(weights, back.bank.tensors(back.slot, "w"),
                                          strict=True))
    assert "s1" not in runner.parked and "s2" in runner.parked


def test_a_parked_adapter_comes_back_bit_for_bit(tiny_dir):
    """The worker's host tier (workers/parked.py): an adapter with optimizer steps behind it
    and gradients pending is parked (its bank slot freed, and taken by another) and comes
    back with the same weights, gradients, moments, step count and pending datums, bit for
    bit."""
    import torch
    from helpers import adapter_snapshot, ce_request, make_engine

    from twinkled.protocol.types import AdamParams, EngineInputError, LoraConfig
    from twinkled.workers.parked import HostTier

    engine = make_engine(tiny_dir)
    vocab, gen = engine.model.vocab_size, torch.Generator().manual_seed(0)
    engine.add_adapter("a", LoraConfig(rank=4, seed=1))
    for _ in range(2):
        engine.forward_backward([ce_request("a", gen, vocab, [5, 7])])
        engine.optim_step("a", AdamParams(learning_rate=1e-2))
    engine.forward_backward([ce_request("a", gen, vocab, [6])])  # gradients pending
    before = adapter_snapshot(engine, "a"), engine.adapter_info("a")
    tier = HostTier(engine)
    tier.park("a")
    assert not engine.has_adapter("a") and "a" in tier
    engine.add_adapter("b", LoraConfig(rank=4, seed=2))  # the slot a had
    tier.unpark("a")
    after = adapter_snapshot(engine, "a"), engine.adapter_info("a")
    assert after[1] == before[1] and before[1].steps == 2 and before[1].pending == 1
    assert before[0].keys() == after[0].keys()
    assert all(before[0][k].equal(after[0][k]) for k in before[0])
    assert "a" not in tier and engine.pool.get("a").slot != engine.pool.get("b").slot
    # Inside a step in flight (a prefetch: `grow` False) it takes a free slot of its bank,
    # bit for bit the same (on a GPU through the side stream: TWINKLE_TEST_DEVICE=cuda);
    # with none free it says so, and stays parked (brought in after the step instead).
    tier.park("a")
    tier.unpark("a", grow=False)
    again = adapter_snapshot(engine, "a")
    assert all(before[0][k].equal(again[k]) for k in before[0])
    tier.park("a")
    for i in range(3):  # the bank's 4 slots: b and these three
        engine.add_adapter(f"c{i}", LoraConfig(rank=4, seed=3 + i))
    with pytest.raises(EngineInputError, match="no free bank slot"):
        tier.unpark("a", grow=False)
    assert "a" in tier and not engine.has_adapter("a")


def test_a_parked_adapter_comes_in_inside_the_step_in_flight_charged_to_its_tenant(
        tiny_dir, tmp_path):
    """Prefetch: a request for an adapter parked in host memory, arriving while another
    tenant's training step runs, has it brought in inside that step (between its
    micro-batches; on a GPU the copy overlaps its kernels), not after it: a prefetch hit,
    with the adapter bit for bit as parked, and the workers' time the moves took charged to
    the fair share of the tenant that needed them (not to the one whose step it rode in)."""
    import asyncio

    one = adapter_bytes(Config(model=tiny_dir).model_config, 4)

    async def go():
        # (preempt_ms: flo's step runs in micro-batches, between which the moves run)
        async with service(tiny_dir, tmp_path, adapter_memory_gb=2.5 * one / GiB,
                           host_adapter_memory_gb=2.5 * one * 16 / 20 / GiB,
                           preempt_ms=1) as box:
            lane = box.svc.lanes.all[0]
            parked = await box.create("pat", seed=1)
            f = box.fwdbwd("pat", parked, 1, [5, 7], seed=3)
            o = box.optim("pat", parked, 2)
            await done(f, o)
            before = await _scores(box, [parked], 3, ["pat"])
            flood = await box.create("flo", seed=2)
            await box.create("flo", seed=4)  # the bank is full: pat's adapter goes to host
            assert lane.residency.tiers.on_host(parked)
            big = box.fwdbwd("flo", flood, 1, [60] * 24, seed=5)
            while not lane.executor.can_join():  # flo's step is in flight
                await asyncio.sleep(0.0005)
            more = box.fwdbwd("flo", flood, 2, [60] * 24, seed=6)  # queued behind it
            await box.svc.ensure_loaded(box.store.runs.get(parked))
            owed = lane.planner.fair.tenant("pat").owed  # paid with its next request
            await done(big, more)
            status = lane.residency.tiers.status()
            after = await _scores(box, [parked], 4, ["pat"])
            return status, before, after, owed, lane.planner.fair.tenant("pat").owed

    status, before, after, paid, left = run(go())
    assert status["prefetch"] == {"hits": 1}, status
    assert status["moves"]["from_host"] == 1
    assert after == before  # bit for bit
    assert paid > 0 and left == 0


def test_a_move_charged_to_an_idle_tenant_is_paid_when_it_rejoins():
    """An idle tenant rejoins fair share at the current virtual clock; a move charged to it
    just before (its adapter brought in for the request that comes next) would vanish in
    that max, and the move be free at the others' expense: it is owed, and paid on top."""
    from test_scheduler import flood

    from scheduler import Planner

    p = Planner(token_budget=1024, target_step_s=0)
    flood(p, "busy", "m1", 4)
    p.complete(p.next_step())  # the clock moves on; "late" has been idle all along
    p.charge("late", 0.5)
    flood(p, "late", "m2", 1)
    assert p.fair.tenant("late").vtime == pytest.approx(p.fair.clock + 0.5)


def test_tenant_caps_on_runs_and_resident_bytes_say_what_they_mean(tiny_dir, tmp_path):
    """Per-tenant caps (core/residency.py, core/tenants.py): a tenant over its resident
    bytes cap parks its own least recently used adapter, not another tenant's colder one;
    an adapter larger than the cap by itself is refused with the numbers and the key; and
    runs parked for room still count against the runs cap (parking must not free a place)."""
    from twinkled.core.adapter_room import NoRoom
    from twinkled.protocol.errors import UserError

    one = adapter_bytes(Config(model=tiny_dir).model_config, 4)
    caps = {"ann": {"max_resident_bytes": int(1.5 * one)},
            "tim": {"max_resident_bytes": int(0.5 * one)}, "cat": {"max_adapters": 2}}

    async def go():
        async with service(tiny_dir, tmp_path, adapter_memory_gb=2.5 * one / GiB,
                           host_adapter_memory_gb=10 * one / GiB, tenants=caps) as box:
            for name in caps:
                box.store.tenants.ensure(name)
            box.svc.refresh_tenants()
            residency = box.svc.lanes.all[0].residency
            cat = await box.create("cat", seed=4)
            await box.create("cat", seed=5)
            bob = await box.create("bob", seed=1)  # the bank is full: cat's first is parked
            await _until(lambda: not residency.is_open(cat))
            with pytest.raises(UserError, match=r"2 runs loaded.*max_adapters"):
                await box.create("cat", seed=6)  # one of her two is parked: still two
            first = await box.create("ann", seed=2)  # (cat's second one is parked)
            await box.create("ann", seed=3)  # over ann's cap: her first one is parked
            await _until(lambda: not residency.is_open(first))
            assert residency.is_open(bob) and residency.tiers.on_host(first)
            with pytest.raises(NoRoom, match=r"tenant 'tim'.*max_resident_bytes"):
                await box.create("tim")

    run(go())


async def _until(test, within: float = 30.0) -> None:
    """Wait until `test()` holds (a park runs behind the create that needed it)."""
    import asyncio

    for _ in range(int(within / 0.01)):
        if test():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("it never happened")


def test_a_node_whose_disk_cannot_hold_the_adapter_refuses_it_with_the_numbers(tmp_path):
    """The last tier is the disk: an adapter whose state it has no free room for is the one
    capacity refusal left besides the GPU budget, naming what it needs and what is free
    (its directory need not exist yet: the nearest one that does is asked)."""
    import shutil

    from twinkled.core.adapter_room import NoRoom, check_disk

    free = shutil.disk_usage(tmp_path).free
    check_disk(tmp_path / "live" / "not-yet", 1)
    with pytest.raises(NoRoom, match=r"no disk room.*iB free"):
        check_disk(tmp_path / "live", free + 2**40)


def test_an_adapter_coming_in_from_host_memory_is_never_spilled_to_disk_meanwhile(tiny_dir,
                                                                                   tmp_path):
    """Two runs come back at once: X from host memory, Y from disk. X's unpark is in flight
    when Y's room is made: a resident run is parked to host memory, and the one there to
    make room for it is X itself. Spilled to disk then, X left the bank the moment it came
    back, and its next request failed with "no adapter loaded" (seen at 1,000 runs on the
    CPU). A run being brought in is not a candidate."""
    import asyncio

    one = adapter_bytes(Config(model=tiny_dir).model_config, 4)
    tiers = {"adapter_memory_gb": 2.5 * one / GiB,
             "host_adapter_memory_gb": 1.5 * one * 12 / 20 / GiB}

    async def go():
        async with service(tiny_dir, tmp_path, **tiers) as box:
            x, y, r1, r2 = await _create(box, 4)
            tenant = {x: "t0", y: "t1", r1: "t2", r2: "t3"}
            for m in (y, x, r1, r2):  # y, then x, then r1 and r2 trained last
                await _op(box, tenant[m], m, lambda m=m: box.fwdbwd(tenant[m], m, 1, [5, 7]))
                await _op(box, tenant[m], m, lambda m=m: box.optim(tenant[m], m, 2))
            residency = box.svc.lanes.all[0].residency
            assert residency.tiers.on_host_models() == [x]  # y went on to disk
            assert await residency.send_away(r1)  # a free slot in the bank: x needs no park
            # Each move answers after a round trip, as a worker process's does (in
            # process it would answer at once, before anything else could run).
            executor = box.svc.lanes.all[0].executor
            moved = executor.move

            async def round_trip(frame, overlap=False):
                await asyncio.sleep(0.05)
                return await moved(frame, overlap=overlap)

            executor.move = round_trip
            await asyncio.gather(*(box.svc.ensure_loaded(box.store.runs.get(m))
                                   for m in (x, y)))
            for m in (x, y):  # each answers where it left off
                f = box.fwdbwd(tenant[m], m, 3, [6])
                await done(f)
                assert f.error is None, f.error

    run(go())
