"""How a step is filled: whether a training step is a half-size probe, how much of an op
fits (whole, cut between datums, or not at all), and which requests a sampling step takes.
Pure functions over the cost model; the planner (planner.py) decides whose op comes next."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import replace

from .cost import CostModel, StepShape
from .fairness import Fairness
from .queues import Work

PROBE_EVERY = 8  # every 8th training step is a half-size probe (is_probe)
# A step shortened for a tenant whose whole work fits (processor sharing, Planner._train_step)
# keeps at least this share of the step target. Each step pays the fixed cost again: a
# small tenant that sends its next step as soon as it has the last one back (no think time)
# would otherwise have every step cut to about twice its own, and the fixed cost paid
# that often. Measured on the CPU tiny model next to a flooder (bench_flood, 3 clients x 4
# requests of 48 x 64 in flight; fixed cost ~10 ms, target 60-100 ms): steps of twice the
# small tenant's own left the flooder 0.33-0.5x of its throughput alone, 0.6-0.66x so.
MIN_SHARED_STEP = 0.5


def is_probe(runs: dict[str, list[list[Work]]], target: float, budget: int, cost: CostModel,
             automatic: bool, nth: int) -> bool:
    """Whether this step is a probe, packed to half the target and half the budget.

    A tenant alone sends steps that all look alike, from which no fit can tell a step's
    fixed cost from what its rows cost, and the automatic target is made of that fixed
    cost. Steps of two sizes tell them apart, for ~1% of throughput. So every
    PROBE_EVERY-th step is a probe when the target is automatic, unless the recent steps
    already differ in size, or the step would hold all the waiting work anyway: halving
    that one would push some tenants a whole step back (measured through the daemon on
    an H100, 8 equal tenants: p99 0.28 s -> 0.6 s) and teach the model nothing a full
    step would not.
    """
    if not automatic or nth % PROBE_EVERY:
        return False
    if cost.steps_vary():
        return False
    waiting = StepShape()
    for model_runs in runs.values():
        for run in model_runs:
            add_run(waiting, run)
    return waiting.tokens > budget or cost.predict(waiting) > target


def add_run(shape: StepShape, run: list[Work]) -> StepShape:
    """`shape` with the rows still to plan of `run` (one model's consecutive train ops)
    added, as one more adapter."""
    for w in run:
        shape.add(w.parts[w.taken:] if w.parts else [w.tokens], w is run[0])
    return shape


def fills_step(runs: Iterable[list[Work]], target: float, budget: int, cost: CostModel) -> bool:
    """Whether these runs of queued train ops hold at least a step's worth (by `target`
    seconds or `budget` tokens). Stops at the first run that fills it."""
    shape = StepShape()
    for run in runs:
        add_run(shape, run)
        if shape.tokens >= budget or cost.predict(shape) >= target:
            return True
    return False


def fit_work(w: Work, shape: StepShape, new_model: bool, target: float, budget: int,
             cost: CostModel, first: bool) -> tuple[Work, list[int]] | None:
    """`w` whole, or its first datums that fit, or None; with the datums' lengths.

    The step is filled until its predicted time reaches `target`: a datum goes in while
    the step stays within `budget` tokens and its time so far is under the target
    (so a step ends at most one datum past the target, and never short of it while work
    is waiting: its fixed cost stays under the share the target was chosen for). An op
    that does not fit is cut between datums, so one huge request cannot hold a step (and
    every other tenant) for long; a step's first piece may overflow by one datum rather
    than never run.
    """
    lengths = w.parts[w.taken:] if w.parts else [w.tokens]
    tokens_room = budget - shape.tokens
    seconds = cost.predict(shape) + (cost.adapter_cost if new_model else 0.0)
    n = size = 0
    for length in lengths:
        if (size + length > tokens_room or seconds >= target) and not (first and n == 0):
            break
        n += 1
        size += length
        seconds += cost.row_cost(length)
    if n == 0:
        return None
    if not w.parts:
        return w, lengths
    hi = w.taken + n
    piece = piece_of(w, w.taken, hi, size, final=hi == len(w.parts))
    w.taken = hi
    return piece, lengths[:n]


def piece_of(w: Work, lo: int, hi: int | None, tokens: int, final: bool) -> Work:
    if lo == 0 and final:
        return w  # not cut: the op itself
    return replace(w, tokens=tokens, lo=lo, hi=hi, final=final, parts=None)


def pack_samples(samples: dict[str, deque[Work]], fair: Fairness, budget: int) -> list[Work]:
    """A sampling step's requests, taken off `samples` (tenant -> FIFO): tenants take turns,
    the one served the fewest tokens for its weight first, up to `budget` tokens (one request
    at least, however long)."""
    taken: list[Work] = []
    used = 0
    while True:
        waiting = [fair.tenant(n) for n, q in samples.items() if q]
        if not waiting:
            return taken
        t = min(waiting, key=lambda c: (c.served_tokens / c.weight, c.name))
        w = samples[t.name][0]
        if taken and used + w.tokens > budget:
            return taken
        samples[t.name].popleft()
        taken.append(w)
        used += w.tokens
        t.served_tokens += w.tokens
