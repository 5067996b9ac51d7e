"""Whose rows a training step takes, and what each tenant pays for them (planner.py, rule 3).

Tenants take turns in weighted-fair order by time (fairness.py) and a tenant's models take
turns, until the step's time target or token budget is reached (an op that does not fit is
cut between datums: packing.fit_work). The step's fixed cost is then shared among its
tenants, and the barriers right behind its ops ride at its end. The planner (planner.py)
sets the target and keeps what it needs of who was served.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .cost import CostModel, StepShape
from .fairness import Fairness
from .packing import fit_work
from .queues import ModelQueues, Work


@dataclass
class Rows:
    """What `take_rows` took for a training step."""

    work: list[Work]  # the ops (and pieces of cut ops) in the order taken
    shape: StepShape  # as the cost model sees them
    charged: dict[str, float]  # tenant -> seconds its rows add to the step
    left: bool  # work was left over: the tenants contended for this step


def train_runs(queues: ModelQueues) -> dict[str, list[list[Work]]]:
    """Tenant -> per-model runs of train ops (ModelQueue.run_of_train)."""
    runs: dict[str, list[list[Work]]] = {}
    for model, q in queues.items():
        run = q.run_of_train()
        if run:
            runs.setdefault(queues.tenant_of(model), []).append(run)
    return runs


def take_rows(runs: dict[str, list[list[Work]]], queues: ModelQueues, fair: Fairness,
              cost: CostModel, target: float, budget: int, floor: float) -> Rows:
    """Take rows of `runs` (emptied as they go) for a step of `target` seconds and `budget`
    tokens, charging each tenant what its rows add; a tenant whose whole work fits
    shortens the target, not below `floor`."""
    taken: list[Work] = []
    shape = StepShape()
    models: set[str] = set()
    charged: dict[str, float] = {}  # tenant -> seconds its rows add to the step
    weights = sum(fair.tenant(n).weight for n in runs)  # of the tenants waiting
    while runs:
        t = fair.pick([fair.tenant(n) for n in runs])
        model_runs = runs[t.name]
        i = t.rr % len(model_runs)
        w = model_runs[i][0]
        new_model = w.model not in models
        fit = fit_work(w, shape, new_model, target, budget, cost, first=not taken)
        if fit is None:
            break
        piece, lengths = fit
        before = cost.predict(shape)
        shape.add(lengths, new_model)
        models.add(w.model)
        added = cost.predict(shape) - before
        taken.append(piece)
        t.charge(added, piece.tokens)
        charged[t.name] = charged.get(t.name, 0.0) + added
        t.rr += 1
        if piece.final:
            model_runs[i].pop(0)
            queues[w.model].take(w)
        else:  # the rest of a cut op waits for the next step; its model stops here
            model_runs[i].clear()
        if not model_runs[i]:
            model_runs.pop(i)
        if not model_runs:
            del runs[t.name]
            if piece.final and target < math.inf:
                # All this tenant has is in the step. As under processor sharing, it
                # should have it back after its own step's time x (weights waiting /
                # its weight), not after a whole target's worth of others' rows: a small
                # tenant next to a flooder rides a step about twice its own, not T.
                # Not below MIN_SHARED_STEP of the target, though: every step pays the
                # fixed cost again (see MIN_SHARED_STEP).
                own = cost.fixed_cost + charged[t.name]
                target = min(target, max(floor, own * weights / t.weight))
    return Rows(taken, shape, charged, bool(runs))


def share_fixed_cost(fair: Fairness, cost: CostModel, rows: Rows) -> None:
    """The step's fixed cost is shared in proportion to what each tenant's rows add."""
    total = sum(rows.charged.values())
    for name, added in rows.charged.items():
        share = added / total if total > 0 else 1 / len(rows.charged)
        t = fair.tenant(name)
        t.charge(cost.fixed_cost * share)
        if rows.left:  # work is left over: the tenants contended for this step
            t.contended_s += added + cost.fixed_cost * share


def take_barriers_behind(queues: ModelQueues, taken: list[Work]) -> list[Work]:
    """Barriers right behind a step's ops (`taken`), which run at its end (after all its
    rows), taken from their queues."""
    behind = []
    for model in dict.fromkeys(w.model for w in taken if w.final):
        q = queues[model]
        w = q.pending.get(q.next_seq)
        if w is not None and w.is_barrier:
            q.pending.pop(w.seq)
            q.next_seq += 1
            q.in_flight += 1
            behind.append(w)
    return behind
