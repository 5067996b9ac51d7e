"""Preemptible training steps: small work that runs inside the training step in flight.

A step next to a backlog is long (its fixed cost is paid once for a target's worth of rows).
A small tenant whose request arrives while it runs would wait for the rest of it and then
ride the next one. Instead the step runs in micro-batches of about `preempt_s` each
(`micro_tokens`), and between two of them its rank runs a *join*: the small tenant's
forward_backward and the optim_step behind it, answered at once. So the small tenant waits
about one micro-batch, not a step, and the loop need not idle between steps waiting for its
client (gather.py), which is where a flooder's throughput went.

What keeps it right:
- a join holds only models the step in flight does not (their gradients are apart: an
  optim_step in a join sees all of its model's earlier forward_backwards, none of the
  step's), and whole ops in seq_id order, each model's queue as a normal step takes them;
- a join holds what its tenant's fair share allows: a tenant more than the step's time
  ahead of the step's tenants in virtual time (fairness.py) waits; it is charged for what
  its rows cost like any step's;
- a join is a pass of its own: it delays the step in flight by all it costs, the fixed
  cost of a pass included, and its tenants are charged that whole cost. The joins of one
  step together delay it by at most a micro-batch's time (or JOIN_SHARE of its predicted
  time) divided by its tenants, each of whom waits the whole delay (planner.py). Where
  a pass's fixed cost is large against its rows (Qwen3.5's launch-bound delta rule: 0.45 s
  for one row of 512, 0.65 s for eight), equal tenants then ride steps together instead of
  one pass each (before: 17 joins inside one step, 9.7 s where the step's own passes took
  0.9, and each joined tenant charged only what its rows added).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from .cost import CostModel, StepShape
from .fairness import Fairness
from .queues import OPTIM, TRAIN, ModelQueues, Work


def micro_tokens(shape: StepShape, predicted_s: float, preempt_s: float) -> int:
    """Tokens of a micro-batch that takes about `preempt_s` of a step predicted to take
    `predicted_s` (0: the step is short enough to run as one). A share of the step, not
    tokens at a fitted rate: the step was packed by the same cost model, so its errors
    cancel (on a loaded CPU the fitted per-row cost once made micro-batches of one row,
    each paying a pass: the step took 2.3x as long)."""
    if preempt_s <= 0 or predicted_s <= preempt_s or shape.tokens <= 0:
        return 0
    return max(1, math.ceil(shape.tokens * preempt_s / predicted_s))


def join_candidates(queues: ModelQueues,
                    fair: Fairness, running: list[Work], predicted_s: float,
                    ready: Callable[[str], bool]) -> list[tuple[str, list[Work]]]:
    """(tenant, a model's ops) that may join the step running `running` (predicted to take
    `predicted_s`), in fair order: models of tenants
    not in it (a tenant's other models wait their turn), nothing of theirs in flight, whose
    head is a forward_backward (the run of them, whole) or an optim_step with no rows
    queued behind it; `ready(model)`: the caller's say
    (e.g. a pipelining client's optim_step is still on its way)."""
    in_step = {w.model for w in running}
    names = {w.tenant for w in running}
    step_tenants = [fair.tenant(t) for t in names]
    # The step's tenants were charged for all of it when it was planned; a tenant idle
    # until now joins at the clock (fairness.py), and may have as much of the machine
    # while the step runs: it may be up to the step's time ahead of them.
    ahead = min((t.vtime for t in step_tenants), default=float("inf"))
    out = []
    for model, q in queues.items():
        head = q.head()
        if model in in_step or head is None or head.taken or not ready(model):
            continue
        tenant = fair.tenant(queues.tenant_of(model))
        if tenant.name in names or tenant.vtime > ahead + predicted_s / tenant.weight:
            continue  # past its share next to the step's tenants: it waits its turn
        if head.kind == TRAIN:
            ops = q.run_of_train()
            behind = q.pending.get(ops[-1].seq + 1)
            if behind is not None and behind.kind == OPTIM:
                ops.append(behind)  # rides behind its rows, as in a normal step
        elif head.kind == OPTIM and not q.rows_behind(head):
            ops = [head]
        else:
            continue
        out.append((tenant.name, ops))
    out.sort(key=lambda c: (fair.tenant(c[0]).vtime, c[0]))
    return out


def fit_join(cost: CostModel, candidates: list[tuple[str, list[Work]]], limit_s: float
             ) -> tuple[list[Work], StepShape, dict[str, float]]:
    """The candidates' ops whose pass fits `limit_s` of predicted time (its fixed cost
    included), in order (one that does not fit is skipped); with the join's shape and what
    each tenant's rows add to it."""
    shape, taken, charged = StepShape(), [], {}
    for tenant, ops in candidates:
        trial = StepShape(shape.tokens, shape.rows, shape.pairs, shape.adapters)
        first = True
        for w in ops:
            if w.kind == TRAIN:
                trial.add(w.parts or [w.tokens], first)
                first = False
        if cost.predict(trial) > limit_s:
            continue
        charged[tenant] = charged.get(tenant, 0.0) + (cost.predict(trial)
                                                      - cost.predict(shape))
        shape = trial
        taken += ops
    return taken, shape, charged


def join_charges(cost: CostModel, added: dict[str, float]) -> dict[str, float]:
    """What each tenant of a join pays: what its rows add, and the pass's fixed cost shared
    in proportion (a join's pass is theirs alone: the step in flight paid its own)."""
    total = sum(added.values())
    share = {t: (a / total if total > 0 else 1 / len(added)) for t, a in added.items()}
    return {t: a + cost.fixed_cost * share[t] for t, a in added.items()}
