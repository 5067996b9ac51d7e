"""A small tenant next to a flooder (issue 32, item 2): the flooder's backlog neither holds
the loop between steps (the gather) nor keeps the small tenant's work out of the next step
(the planner), and the small tenant's work joins the flooder's step in flight between two
of its micro-batches (preemptible steps, scheduler/joins.py). Planner and gather with
synthetic costs; the engine and the in-process service on the tiny model. No timing
assertions (a wait that would last an hour on the old code is cut by a generous timeout)."""

from __future__ import annotations

import asyncio
import itertools

from scheduler import OPTIM, TRAIN, CostModel, Planner, Step, StepShape, Work
from scheduler.planner import JOIN_SHARE
from twinkled.core.gather import Gather
from twinkled.core.metrics import Metrics

_ids = itertools.count()
ROWS, SEQ = 48, 64  # a flooder's request: 48 datums of 64 tokens (bench_flood's CPU shape)


class Open:
    """Residency as far as the gather asks: every model is open."""

    def is_open(self, model: str) -> bool:
        return True


def fwdbwd(tenant: str, model: str, seq: int, rows: int) -> Work:
    return Work(f"w{next(_ids)}", tenant, TRAIN, rows * SEQ, model, seq, parts=[SEQ] * rows)


def optim(tenant: str, model: str, seq: int) -> Work:
    return Work(f"w{next(_ids)}", tenant, OPTIM, 0, model, seq)


def trained_cost() -> CostModel:
    """A cost model that has seen steps of a CPU-like card: 10 ms fixed, 20 us a token."""
    cost = CostModel()
    for i in range(40):
        s = StepShape(adapters=1 + i % 3)
        s.add([SEQ] * (4 + i % 20))
        cost.observe(s, 0.010 + 20e-6 * s.tokens + 0.001 * s.adapters)
    return cost


def flooded_planner() -> Planner:
    """Three flood models, each with four 48 x 64 forward_backwards queued (an optim_step
    behind the fourth), and a small tenant's model."""
    p = Planner(token_budget=16384, cost=trained_cost())
    for i in range(3):
        m = f"flood:{i}"
        p.open_model(m, "flood")
        for seq in range(1, 5):
            assert p.submit(fwdbwd("flood", m, seq, ROWS))
        assert p.submit(optim("flood", m, 5))
    p.open_model("small", "small")
    return p


def test_a_flooders_backlog_is_more_than_an_optim_step_could_ride_behind():
    p = flooded_planner()
    assert p.step_target() < 1.0  # the time bound is on: a 48 x 64 op is cut over steps
    assert not p.optim_may_ride("flood:0")  # four ops queued, a barrier among them
    p.open_model("one", "flood")
    p.submit(fwdbwd("flood", "one", 1, 2 * ROWS))
    assert not p.optim_may_ride("one")  # one op, but more than a step takes
    assert p.submit(fwdbwd("small", "small", 1, 1))
    assert p.optim_may_ride("small")  # one row: its optim_step would ride behind it
    p.submit(optim("small", "small", 2))
    assert not p.optim_may_ride("small")  # it is in already


def test_a_small_tenants_work_is_in_the_next_step_next_to_a_queued_flood():
    """The small tenant's forward_backward and the optim_step behind it, arriving while the
    flooder's requests are queued and one of its steps runs, are in the very next step."""
    p = flooded_planner()
    running = p.next_step()
    assert running.kind == "train" and {w.tenant for w in running.work} == {"flood"}
    p.submit(fwdbwd("small", "small", 1, 1))
    p.submit(optim("small", "small", 2))
    p.complete(running, running.predicted_s)
    nxt = p.next_step()
    small = [(w.kind, w.final) for w in nxt.work if w.tenant == "small"]
    assert small == [(TRAIN, True), (OPTIM, True)]
    assert any(w.tenant == "flood" for w in nxt.work)  # the flooder rides along


def test_the_gather_does_not_hold_a_step_for_a_flooders_optim_step():
    """After a step that ran a flood piece and the small tenant's pair, the gather waits
    for the small tenant's next pair and for nothing else: the flood model counts as
    pipelining (an optim_step came in behind its rows once) and its last queued op is a
    forward_backward, but its backlog is more than a step, so its optim_step could not
    ride anyway. The old gather waited for it the whole window (here an hour; the CPU
    bench's default of 20 ms idled the worker before every step)."""
    p = flooded_planner()
    p.submit(fwdbwd("small", "small", 1, 1))
    p.submit(optim("small", "small", 2))

    async def scenario() -> None:
        wake = asyncio.Event()
        gather = Gather(p, Open(), Metrics(None), 3600.0, wake)
        # flood:0's optim_step came in while its rows were queued: a pipelining client.
        gather.arrived("flood:0", TRAIN)
        gather.arrived("flood:0", OPTIM)
        gather.arrived("flood:0", TRAIN)
        p.submit(fwdbwd("flood", "flood:0", 6, ROWS))  # its last queued op: a fwdbwd
        assert gather.is_paired("flood:0") and p.queues.awaits_barrier("flood:0")
        step = p.next_step()
        assert {w.tenant for w in step.work} == {"flood", "small"}
        p.complete(step, step.predicted_s)
        gather.stepped(step, step.predicted_s)
        waiting = asyncio.create_task(gather.wait())
        await asyncio.sleep(0)
        assert not waiting.done()  # the small tenant's client has not sent its next pair
        p.submit(fwdbwd("small", "small", 3, 1))
        p.submit(optim("small", "small", 4))
        wake.set()
        await asyncio.wait_for(waiting, 30)  # on the old code: an hour

    asyncio.run(scenario())
    assert isinstance(p.next_step(), Step)


def test_a_step_planned_while_a_served_tenant_is_away_is_short():
    """The small tenant's pair rode a step; while its client sends the next one, the
    flooder's step is bounded by half the target (the old planner packed a whole target),
    so the small tenant's next pair waits for a short step; the step after the small
    tenant is back is not bounded so."""
    p = flooded_planner()
    p.next_step()  # the flooder's step, before the small tenant comes
    p.submit(fwdbwd("small", "small", 1, 1))
    p.submit(optim("small", "small", 2))
    p.complete(running := p.next_step(), 0.05)
    assert {w.tenant for w in running.work} == {"flood", "small"}
    target = p.step_target()
    away = p.next_step()  # the small tenant's client is sending its next pair
    assert {w.tenant for w in away.work} == {"flood"}
    assert away.predicted_s < 0.75 * target
    p.complete(away, away.predicted_s)
    full = p.next_step()  # nobody the last step served is away
    assert full.predicted_s >= 0.9 * target


# -- preemptible steps (scheduler/joins.py): a small tenant's work joins the step in flight --


def preempting_planner() -> Planner:
    p = flooded_planner()
    p.preempt_s = 0.02
    return p


def test_a_small_tenants_pair_joins_the_flooders_step_in_flight():
    """While the flooder's step runs, the small tenant's forward_backward and the optim_step
    behind it may join it (nothing of the flooder's does: its models are in the step, or
    its ops are more than a micro-batch); the old planner had no such thing."""
    p = preempting_planner()
    running = p.next_step()
    assert {w.tenant for w in running.work} == {"flood"}
    assert p.join_step(running) is None  # nothing small is queued
    p.submit(fwdbwd("small", "small", 1, 1))
    assert p.join_step(running, ready=lambda m: False) is None  # e.g. its optim_step is due
    p.submit(optim("small", "small", 2))
    j = p.join_step(running)
    assert j is not None and j.joined
    assert [(w.tenant, w.kind) for w in j.work] == [("small", TRAIN), ("small", OPTIM)]
    assert p.join_step(running) is None  # the small model is in flight now
    p.complete(j)
    p.complete(running, running.predicted_s)
    assert p.queues.next_seq("small") == 3


def test_a_tenants_other_models_do_not_join_its_own_step():
    """The flooder's third model, not in the step in flight, is no small tenant: it waits
    for its turn (one that were small would still not join its tenant's own step)."""
    p = preempting_planner()
    p.open_model("flood:tiny", "flood")
    running = p.next_step()
    assert "flood:tiny" not in {w.model for w in running.work}
    p.submit(fwdbwd("flood", "flood:tiny", 1, 1))
    assert p.join_step(running) is None


def test_a_join_respects_fair_share():
    """A tenant more than the step's time ahead of the step's tenants in virtual time (it
    was served more) waits."""
    p = preempting_planner()
    running = p.next_step()
    p.submit(fwdbwd("small", "small", 1, 1))
    p.tenant("small").vtime = p.tenant("flood").vtime + running.predicted_s + 0.01
    assert p.join_step(running) is None


def fixed_heavy_planner(tenants: int) -> Planner:
    """Qwen3.5's shape of costs on a GPU (session 10's trace: a pass of one 512-token row
    0.45 s, of eight 0.65 s): a large fixed cost, rows nearly free; the automatic step
    target and micro-batches. `tenants` tenants with one row of 512 queued each (together
    one step), and a tenant "late" whose row comes while that step runs."""
    cost = CostModel()
    for i in range(40):
        s = StepShape(adapters=1 + i % 8)
        s.add([512] * (1 + i % 8))
        cost.observe(s, 0.40 + 30e-6 * s.tokens + 0.005 * s.adapters)
    p = Planner(token_budget=16384, cost=cost, target_step_s=None, preempt_s=None)
    for i in range(tenants):
        p.open_model(f"t{i}", f"t{i}")
        p.submit(Work(f"w{next(_ids)}", f"t{i}", TRAIN, 512, f"t{i}", 1, parts=[512]))
    p.open_model("late", "late")
    return p


def test_a_join_among_equal_tenants_whose_pass_is_mostly_fixed_cost_rides_the_next_step():
    """A join is a pass of its own, and every tenant of the step waits for it. Where a
    pass is mostly fixed cost, a tenant like the step's seven waits for the next step rather
    than cost each of them a whole pass (before: the fixed cost was left out, and equal
    tenants of Qwen3.5-9B each took a pass of their own inside a step, 17 in one); next
    to a single flooder the same late row still joins."""
    p = fixed_heavy_planner(7)
    running = p.next_step()
    assert len({w.tenant for w in running.work}) == 7 and p.preempt_limit() > 0
    p.submit(Work(f"w{next(_ids)}", "late", TRAIN, 512, "late", 1, parts=[512]))
    assert p.join_step(running) is None
    assert {w.tenant for w in p.next_step().work} == {"late"}  # it rides the next step

    p = fixed_heavy_planner(1)
    running = p.next_step()
    p.submit(Work(f"w{next(_ids)}", "late", TRAIN, 512, "late", 1, parts=[512]))
    j = p.join_step(running)
    assert j is not None and {w.tenant for w in j.work} == {"late"}


def test_the_joins_of_one_step_stay_within_its_allowance_and_pay_their_pass():
    """Small tenants' work joins a long step until the joins together would delay it by
    more than JOIN_SHARE of its predicted time; each joined tenant is charged its pass's
    fixed cost too (before: each join was bounded alone, however many ran, and charged
    only what its rows added)."""
    p = preempting_planner()
    running = p.next_step()
    for i in range(40):
        p.open_model(f"s{i}", f"s{i}")
        p.submit(fwdbwd(f"s{i}", f"s{i}", 1, 1))
    joined = []
    before = {f"s{i}": p.tenant(f"s{i}").vtime for i in range(40)}
    while (j := p.join_step(running)) is not None:
        joined.append(j)
    assert joined
    allowance = max(p.preempt_limit(), JOIN_SHARE * running.predicted_s)  # one tenant
    assert sum(j.predicted_s for j in joined) <= allowance + 1e-9
    waiting = [f"s{i}" for i in range(40) if p.queues.next_seq(f"s{i}") == 1]
    assert waiting  # the allowance ran out before every small tenant joined
    fixed = p.cost.fixed_cost
    for j in joined:
        tenants = {w.tenant for w in j.work}
        paid = sum(p.tenant(t).vtime - before[t] for t in tenants)
        assert paid >= j.predicted_s - 1e-9 >= fixed  # the pass's whole cost, fixed included


def test_a_step_runs_in_micro_batches_only_when_a_served_tenant_may_join():
    """Micro-batches cost passes: a step is cut into them only while a tenant served in the
    last steps is away (its client sending its next request), not for a flooder alone."""
    p = preempting_planner()
    alone = p.next_step()
    assert alone.micro_tokens == 0
    p.complete(alone, alone.predicted_s)
    p.submit(fwdbwd("small", "small", 1, 1))
    p.submit(optim("small", "small", 2))
    served = p.next_step()
    p.complete(served, served.predicted_s)
    assert "small" in {w.tenant for w in served.work}
    away = p.next_step()  # the small tenant's client is sending its next pair
    assert 0 < away.micro_tokens < away.shape.tokens
    assert away.predicted_s >= 0.9 * p.step_target()  # not shortened: the pair will join


def test_a_join_between_micro_batches_changes_no_number(tiny_dir):
    """The flooder's rows in micro-batches of one row, with the small adapter's
    forward_backward and optimizer step run between two of them: the flooder's gradients,
    the small adapter's loss and its weights after the step are those of the same work
    run one after the other, unpreempted."""
    import torch
    from helpers import all_close, ce_request, grads, make_engine, randomize_b, weights

    from twinkled.protocol.types import AdamParams, LoraConfig

    def engine():
        e = make_engine(tiny_dir)
        for name, seed in (("flood", 0), ("small", 1)):
            e.add_adapter(name, LoraConfig(rank=4, alpha=16, seed=seed))
            randomize_b(e, name, seed=3 + seed, std=0.3)
        return e

    def work():
        gen = torch.Generator().manual_seed(7)
        return (ce_request("flood", gen, 256, [12, 9, 15, 7]),
                ce_request("small", gen, 256, [10]))

    adam = AdamParams(learning_rate=1e-2)
    ref = engine()
    flood, small = work()
    want_flood = ref.forward_backward([flood])
    want_small = ref.forward_backward([small])
    ref.optim_step("small", adam)

    got = engine()
    flood, small = work()
    joined = []

    def between() -> None:
        if not joined:  # after the flooder's first micro-batch
            joined.append(got.forward_backward([small]))
            got.optim_step("small", adam)

    got_flood = got.forward_backward([flood], micro_tokens=16, between=between)
    assert joined, "the step ran as one micro-batch: nothing could join it"
    assert all_close(grads(got, "flood"), grads(ref, "flood"), rtol=1e-4)
    assert all_close(weights(got, "small"), weights(ref, "small"), rtol=1e-4)
    for want, have in ((want_flood, got_flood), (want_small, joined[0])):
        assert abs(want[0].metrics["loss:sum"] - have[0].metrics["loss:sum"]) <= 1e-4 * abs(
            want[0].metrics["loss:sum"])


def test_a_small_tenants_pair_is_answered_before_the_flooders_step_ends(tiny_dir, tmp_path):
    """Through the service (in-process engine): the small tenant's forward_backward and
    optim_step, sent while the flooder's long step runs, are answered before that step
    is; its loss is what the same data gave unpreempted, and the flooder's logprobs are
    those of its rows run alone. The old core ran them after the flooder's step."""
    from test_service import done, logprobs, result, service

    async def go():
        async with service(tiny_dir, tmp_path, target_step_ms=60_000, preempt_ms=1) as box:
            core = box.svc.lanes.all[0].core
            small, flood = await box.create("small"), await box.create("flood")
            first = [box.fwdbwd("small", small, 1, [16], seed=1), box.optim("small", small, 2)]
            await done(*first)
            alone = box.fwdbwd("small", small, 3, [16], seed=2, forward_only=True)
            await done(alone)
            # (a step the cost model, still near its prior, predicts at over twice what a
            # pass of the small pair costs, fixed cost included: else the pair rides the next)
            big = box.fwdbwd("flood", flood, 1, [64] * 48, seed=3)
            while not core.stepping:
                await asyncio.sleep(0.001)
            pair = [box.fwdbwd("small", small, 4, [16], seed=2), box.optim("small", small, 5)]
            await done(*pair)
            assert not big.done.is_set()  # answered inside the flooder's step
            await done(big)
            assert all(f.error is None for f in (*pair, big))
            loss = result(pair[0]).metrics["loss:sum"]
            assert abs(loss - result(alone).metrics["loss:sum"]) <= 1e-4 * abs(loss)
            again = box.fwdbwd("flood", flood, 2, [64] * 48, seed=3, forward_only=True)
            await done(again)
            for x, y in zip(logprobs(result(big)), logprobs(result(again)), strict=True):
                assert max(abs(a - b) for a, b in zip(x, y, strict=True)) <= 1e-4

    asyncio.run(asyncio.wait_for(go(), 600))


def test_a_small_pair_queued_before_a_full_step_joins_it_without_new_arrivals(tiny_dir,
                                                                             tmp_path):
    """The small tenant's pair, queued in the same moment as the flooder's request that
    fills the next step (the token budget), joins that step in flight at a micro-batch
    boundary, though nothing arrives afterwards to wake the loop: answered before the
    flooder's step. (The old loop looked for joins only as the step began, before the
    ranks had it, and then only when work arrived: the pair waited out the whole step.)"""
    from test_service import done, service

    async def go():
        async with service(tiny_dir, tmp_path, target_step_ms=60_000, preempt_ms=1,
                           token_budget=ROWS * SEQ) as box:
            small, flood = await box.create("small"), await box.create("flood")
            await done(box.fwdbwd("small", small, 1, [16], seed=1), box.optim("small", small, 2))
            # (small is ahead in fair share now: the flooder's rows go first, filling it)
            big = box.fwdbwd("flood", flood, 1, [SEQ] * ROWS, seed=3)
            pair = [box.fwdbwd("small", small, 3, [16], seed=2), box.optim("small", small, 4)]
            await asyncio.wait_for(done(*pair), 300)
            assert not big.done.is_set()  # answered inside the flooder's step
            await done(big)
            assert all(f.error is None for f in (*pair, big))

    asyncio.run(asyncio.wait_for(go(), 600))


def test_a_worker_process_answers_a_join_before_the_step_it_joined(tiny_dir, tmp_path):
    """The worker process over ZeroMQ: a join sent while a training step of many
    micro-batches runs is answered before that step (its rank runs it between two of
    them), and both steps' ops succeed. (The old group had no joins.)"""
    import random

    from twinkled.core.make_executor import zmq_executor
    from twinkled.protocol.config import Config
    from twinkled.protocol.frames import CreateF, DatumF, StepF, TrainF, buf
    from twinkled.protocol.types import LoraConfig

    def train(adapter: str, rows: int) -> TrainF:
        gen = random.Random(rows)
        data = []
        for _ in range(rows):
            toks = [gen.randrange(200) for _ in range(33)]
            data.append(DatumF(buf(toks[:-1], "int64"), {"target_tokens": buf(toks[1:], "int64")}))
        return TrainF(adapter, data, "cross_entropy", {}, False)

    async def go():
        cfg = Config(model=tiny_dir, data_dir=tmp_path, device="cpu", dtype="float32",
                     worker_threads=1, persist_every=0)
        ex = zmq_executor(cfg, ["cpu"])
        await asyncio.wait_for(ex.start(), 300)
        group = ex.group
        try:
            await group.run(StepF(0, "barrier", [CreateF(a, LoraConfig(rank=4, seed=i))
                                                 for i, a in enumerate(("flood", "small"))]))
            big = asyncio.ensure_future(group.run(StepF(0, "train", [train("flood", 24)],
                                                        micro_tokens=32)))
            while not group.can_join():
                await asyncio.sleep(0.001)
            joined = await asyncio.wait_for(group.send_join(
                StepF(0, "train", [train("small", 1)], join=True)), 300)
            assert not big.done()  # answered inside the flooder's step
            replies = await asyncio.wait_for(big, 300)
            for reply in (*joined, *replies):
                assert all(o.error is None and o.fwdbwd is not None for o in reply.outcomes)
            assert not group.can_join()  # no step in flight
        finally:
            await ex.stop()

    asyncio.run(asyncio.wait_for(go(), 600))
