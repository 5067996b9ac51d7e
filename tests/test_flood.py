"""A small tenant next to a flooder (issue 32, item 2): the flooder's backlog neither holds
the loop between steps (the gather) nor keeps the small tenant's work out of the next step
(the planner). Planner and gather only, with synthetic costs: no torch, no timing
assertions (a wait that would last an hour on the old code is cut by a generous timeout)."""

from __future__ import annotations

import asyncio
import itertools

from scheduler import OPTIM, TRAIN, CostModel, Planner, Step, StepShape, Work
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
        assert gather.is_paired("flood:0") and p.awaits_barrier("flood:0")
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
