"""The planner: what the next engine step holds.

The rule, in order:
1. Barriers ready at the head of their model (optim, save, load, create; every earlier op of
   the model finished) run first, all of them in one step: they are cheap and unblock
   their models. Several models' optim_steps thus run together. When they are all
   optim_steps with no rows of their models queued behind them (they came too late to ride
   behind their rows), they ride at the end of the next training step instead: a step of
   their own would unblock nothing, and costs a round trip and a gather.
2. Samples and training alternate when both are waiting, so neither starves.
3. A training step packs forward/backward ops of many models and tenants (train_rows.py),
   tenant by tenant in weighted-fair order by time (fairness.py); a tenant's models take
   turns. It is bounded twice: by time (its predicted duration, from a cost model learned
   from measured steps (cost.py), stays about `target_step_s`, so a request that arrives
   waits about one short step) and by `token_budget` tokens (memory). A tenant whose whole
   work fits shortens the step to about its own step x (waiting tenants' weights / its
   weight), as processor sharing would: a small tenant next to a flooder gets its step back
   in about twice its time alone (not in less than half the target: MIN_SHARED_STEP). An op
   that does not fit is cut between datums. A model whose next op is a barrier (typically
   the optim_step a client sends right behind its forward_backward) gets it appended to the
   step, to run after the step's rows: a whole training round of every tenant is then one
   step, not two.
4. A sampling step packs samples up to `sample_budget` tokens, tenants taking turns.
5. Preemptible steps (`preempt_s`, joins.py): while a training step runs, a small tenant's
   work that arrives may *join* it, run between two of its micro-batches and answered at
   once (`join_step`); a step that a recently served tenant may want to join runs in
   micro-batches of about `preempt_s` (`Step.micro_tokens`).

Quotas hold work back (it is "paused", and the client is told so) rather than failing it.
The planner is pure: no I/O, no clocks, no torch; the daemon calls submit/next_step/complete
and reports each step's measured seconds to complete().
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from .admission import Admission
from .cost import CostModel, StepShape
from .fairness import Fairness, Ledger, Limits, Tenant
from .joins import fit_join, join_candidates, join_charges, micro_tokens
from .packing import MIN_SHARED_STEP, fills_step, is_probe, pack_samples
from .queues import OPTIM, SAMPLE, TRAIN, ModelQueues, Work
from .train_rows import share_fixed_cost, take_barriers_behind, take_rows, train_runs


@dataclass
class Step:
    kind: str  # "train" | "barrier" | "sample"
    work: list[Work] = field(default_factory=list)
    shape: StepShape | None = None  # a training step's rows, as the cost model sees them
    predicted_s: float = 0.0  # what the cost model predicted it takes
    micro_tokens: int = 0  # micro-batches of at most this many tokens (0: token_budget)
    joined: bool = False  # runs inside the training step in flight (Planner.join_step)
    join_left_s: float | None = None  # how much more its joins may delay it (join_step)


# A preemptible step's micro-batches take about this share of the step target (preempt_s
# None): a small tenant's work waits about that long for the one in flight to end. Each
# micro-batch pays a pass's overhead: on the CPU tiny model next to a flooder, a quarter
# (4 passes a step) left the flooder 0.42-0.71x of its throughput alone.
PREEMPT_SHARE = 0.5
# The joins inside one step may together delay it by a micro-batch's time or this share of
# its predicted time, whichever is more, shared among its tenants (join_step).
JOIN_SHARE = 0.5
# A tenant served in this many recent training steps may join the next ones (_may_be_joined).
JOIN_MEMORY = 4


class Planner:
    def __init__(self, token_budget: int = 16384, sample_budget: int = 65536,
                 target_step_s: float | None = None, cost: CostModel | None = None,
                 preempt_s: float | None = 0.0, ledger: Ledger | None = None):
        """`target_step_s`: how long a training step should take; None derives it from the
        cost model (CostModel.auto_target), 0 turns the time bound off (steps are bounded
        by `token_budget` only, as before the cost model). `preempt_s`: how long a
        micro-batch of a preemptible step takes (joins.py); None: half the step
        target (PREEMPT_SHARE), 0: steps are not preemptible. `ledger`: the tenants'
        virtual times, shared with the other lanes' planners (fairness.py)."""
        self.preempt_s = preempt_s
        self.token_budget = token_budget
        self.sample_budget = sample_budget
        self.target_step_s = target_step_s
        self.cost = cost or CostModel()
        self.fair = Fairness(ledger)
        self.queues = ModelQueues()  # the open models' ops (queues.py)
        self.samples: dict[str, deque[Work]] = {}  # tenant -> FIFO
        self.admission = Admission(self.fair)
        self.steps = 0
        self._train_steps = 0
        self._served: set[str] = set()  # the tenants with rows in the last training step
        self._last_served: dict[str, int] = {}  # tenant -> the training step that last served it
        self._sample_turn = False

    # -- configuration ------------------------------------------------------------------

    def set_tenant(self, name: str, weight: float = 1.0, limits: Limits | None = None) -> None:
        if not weight > 0:
            raise ValueError(f"weight must be positive, got {weight!r}")
        t = self.fair.tenant(name)
        t.weight = weight
        t.limits = limits or Limits()

    def tenant(self, name: str) -> Tenant:
        return self.fair.tenant(name)

    def open_model(self, model: str, tenant: str, next_seq: int = 1,
                   resync: bool = False) -> None:
        """`resync`: resume at the first seq_id that arrives (a model restored after a
        crash, whose client counted on past the state it was restored to)."""
        self.queues.open(model, tenant, next_seq, resync)

    def idle(self) -> bool:
        """Nothing that can run is queued, held back or in flight (ops waiting on a seq_id
        gap cannot run until their client sends the missing one)."""
        return (not any(q.head() is not None or q.in_flight for q in self.queues.values())
                and not any(self.samples.values()) and not self.admission.holds_any())

    def waiting(self, samples: bool = True) -> bool:
        """Work is queued that a step could take now: training or barriers (or held by
        admission), and samples unless `samples` is False."""
        return (any(q.head() is not None for q in self.queues.values())
                or self.admission.holds_any() or (samples and any(self.samples.values())))

    def forget_model(self, model: str) -> None:
        """Drop a model whose ops have all run (its adapter was unloaded)."""
        self.queues.forget(model)

    # -- what the daemon may ask of a model's queue (the rest: `queues`) --------------

    def optim_may_ride(self, model: str) -> bool:
        """Whether an optim_step the model's client sends next could still ride behind its
        rows: all its queued ops are forward/backwards that fit in one step. (A flooder's
        backlog runs over several steps: waiting for its optim_step gains nothing.)"""
        if model not in self.queues:
            return False
        q = self.queues[model]
        run = q.run_of_train()
        if not run or len(run) != len(q.pending):
            return False
        return not fills_step([run], self.step_target(), self.token_budget + 1, self.cost)

    def is_paused(self, work_id: str) -> bool:
        """The work is held back by its tenant's quota."""
        return work_id in self.admission.paused

    @property
    def paused(self) -> set[str]:
        """The ids of the work held back by quotas (admission.py)."""
        return self.admission.paused

    # -- admission ----------------------------------------------------------------------

    def over_quota(self, tenant: str, tokens: int) -> bool:
        return self.admission.over_quota(tenant, tokens)

    def submit(self, w: Work) -> bool:
        """Queue `w`; False if it is held back by its tenant's quota (paused)."""
        if w.model is not None and w.model not in self.queues:
            raise KeyError(f"unknown model {w.model!r}")
        if w.model is not None:
            q = self.queues[w.model]
            if q.resync and not q.pending and not q.in_flight:
                q.next_seq, q.resync = max(q.next_seq, w.seq), False
        if self.over_quota(w.tenant, w.tokens) and not self._fills_gap(w):
            self.admission.hold(w)
            return False
        self._enqueue(w)
        return True

    def _fills_gap(self, w: Work) -> bool:
        # The op a model is waiting for is never held (admission.py)
        return w.model is not None and w.seq == self.queues[w.model].next_seq

    def _enqueue(self, w: Work) -> None:
        t = self.fair.tenant(w.tenant)
        if t.queued_requests == 0:
            self.fair.activate(t)
        t.queued_requests += 1
        t.queued_tokens += w.tokens
        w.admitted_step = self.steps
        if w.kind == SAMPLE:
            self.samples.setdefault(w.tenant, deque()).append(w)
        else:
            q = self.queues[w.model]
            if w.seq in q.pending or w.seq < q.next_seq:
                raise ValueError(f"seq_id {w.seq} of {w.model} is already queued or done")
            q.pending[w.seq] = w

    def _admit_held(self) -> None:
        self.admission.release(self._fills_gap, self._enqueue)

    def withdraw(self, work_id: str, tenant: str) -> bool:
        """Take a queued sample out before it runs (its client went away); False if it is
        not queued any more (it runs or ran)."""
        q = self.samples.get(tenant, ())
        for w in q:
            if w.id == work_id and w.kind == SAMPLE:
                q.remove(w)
                self._dequeued(w)
                return True
        return self.admission.withdraw_sample(work_id, tenant)

    # -- planning -----------------------------------------------------------------------

    def next_step(self, samples: bool = True, train: bool = True) -> Step | None:
        """The next step to run, or None if nothing can run now. `samples` False: no
        sampling step now (the daemon's workers have no room for more samples yet);
        `train` False: no training step now (sampling's turn on the workers is not over)."""
        self._admit_held()
        has_samples = samples and any(self.samples.values())
        sampling = has_samples and (self._sample_turn or not train)
        ready = [w for w in (q.head() for q in self.queues.values())
                 if w is not None and w.is_barrier]
        step = None
        if ready and train and not sampling and self._foldable(ready):
            step = self._train_step(tail=ready)
        if step is None and ready:
            for w in ready:
                self.queues[w.model].take(w)
            step = Step("barrier", ready)
        if step is None:
            if sampling:
                step = self._sample_step()
            elif train:
                step = self._train_step() or (self._sample_step() if has_samples else None)
        if step is not None:
            self._sample_turn = step.kind != "sample"
            self.steps += 1
            for w in step.work:
                self._dequeued(w)
        return step

    def charge(self, tenant: str, seconds: float) -> None:
        """Work done for `tenant` outside a step (its adapter brought into the GPU bank,
        and others parked to make room): its fair share pays for it, not the others'."""
        self.fair.charge_aside(self.fair.tenant(tenant), seconds)

    def _foldable(self, ready: list[Work]) -> bool:
        """Ready barriers may ride at the end of a training step instead of running first
        in a step of their own when they are all optim_steps with no rows of their model
        queued behind them: running them first would unblock nothing now, and a barrier
        step costs a round trip of the workers and a gather for its models' clients. (Such
        an optim_step came too late to ride behind its model's rows.)"""
        return all(w.kind == OPTIM and not self.queues[w.model].rows_behind(w) for w in ready)

    def step_target(self) -> float:
        """The time a training step is packed up to, in seconds (inf: no time bound)."""
        if self.target_step_s is None:
            return self.cost.auto_target()
        return self.target_step_s if self.target_step_s > 0 else math.inf

    def _train_step(self, tail: list[Work] = ()) -> Step | None:
        """A training step, or None if no rows can run; `tail`: ready barriers (of other
        models) that run after its rows (`_foldable`)."""
        runs = train_runs(self.queues)  # tenant -> per-model runs of train ops
        target, budget = self.step_target(), self.token_budget
        floor = target * MIN_SHARED_STEP  # how short a step may get for a tenant's turn
        if not self.preempt_limit() and any(not self.fair.tenant(n).queued_requests
                                            for n in self._served):
            # A tenant the last step served has nothing queued: its client is sending its
            # next request now (a small tenant's training loop). It should find a short
            # step in flight, not a whole target's worth of a flooder's rows.
            target = min(target, floor)
        self._train_steps += 1
        if is_probe(runs, target, budget, self.cost,
                    automatic=self.target_step_s is None, nth=self._train_steps):
            target, budget = target / 2, budget // 2  # see packing.is_probe
        rows = take_rows(runs, self.queues, self.fair, self.cost, target, budget, floor)
        if not rows.work:
            return None
        self._served = set(rows.charged)
        for name in rows.charged:
            self._last_served[name] = self._train_steps
        share_fixed_cost(self.fair, self.cost, rows)
        # Barriers right behind this step's ops run at its end (after all its rows).
        taken = rows.work + take_barriers_behind(self.queues, rows.work)
        for w in tail:
            self.queues[w.model].take(w)
            taken.append(w)
        predicted = self.cost.predict(rows.shape)
        micro = micro_tokens(rows.shape, predicted, self.preempt_limit()) \
            if self._may_be_joined(set(rows.charged)) else 0
        return Step("train", taken, rows.shape, predicted, micro)

    # -- preemptible steps (joins.py) ---------------------------------------------------

    def preempt_limit(self) -> float:
        """How long a micro-batch of a preemptible step should take (0: none are)."""
        if self.preempt_s is None:
            target = self.step_target()
            return target * PREEMPT_SHARE if target < math.inf else 0.0
        return self.preempt_s

    def _may_be_joined(self, in_step: set[str]) -> bool:
        """A tenant served in the last few training steps (JOIN_MEMORY) is not in this one:
        its client is sending its next request, or its queued work did not fit (a flooder's
        rows, ahead in fair share, filled the step), and either would join this step
        between its micro-batches. (Else the step runs in as few passes as it can.)"""
        return any(name not in in_step and self._train_steps - last <= JOIN_MEMORY
                   for name, last in self._last_served.items())

    def join_step(self, running: Step, ready=lambda model: True) -> Step | None:
        """Small work that may run inside `running` (a training step in flight), between
        two of its micro-batches: whole forward_backwards (and the optim_step behind them)
        of models not in it, of tenants within their fair share, in one pass that costs
        (its fixed cost included) no more than what is left of the step's join allowance
        (a micro-batch's time or JOIN_SHARE of its predicted time, shared among the step's
        tenants; joins.py); None if there is none. `ready(model)`:
        whether the model's work may go now (a pipelining client's optim_step may still be
        on its way). Completed like any step (`complete`, without seconds: a join's time
        is not a step's)."""
        if self.preempt_limit() <= 0 or running.kind != "train" or running.joined:
            return None
        if running.join_left_s is None:
            # Every tenant of the step waits the whole of each join: the allowance (a
            # micro-batch's time or half the step's) is shared among them. Next to one
            # flooder a small tenant joins (8B: a 0.18 s pass in a 0.31 s step); among
            # equal tenants of a model whose pass is mostly fixed cost none does, and they
            # ride the next step together.
            tenants = len({w.tenant for w in running.work}) or 1
            running.join_left_s = max(self.preempt_limit(),
                                      JOIN_SHARE * running.predicted_s) / tenants
        limit = running.join_left_s
        if limit <= self.cost.fixed_cost:  # not even a pass fits
            return None
        self._admit_held()
        candidates = join_candidates(self.queues, self.fair, running.work,
                                     running.predicted_s, ready)
        taken, shape, added = fit_join(self.cost, candidates, limit)
        if not taken:
            return None
        for w in taken:
            self.queues[w.model].take(w)
            self._dequeued(w)
        for name, paid in join_charges(self.cost, added).items():
            self.fair.tenant(name).charge(paid, sum(w.tokens for w in taken
                                                    if w.tenant == name))
            self._last_served[name] = self._train_steps
        self.steps += 1
        predicted = self.cost.predict(shape)
        running.join_left_s -= predicted
        return Step("train", taken, shape, predicted, joined=True)

    def _sample_step(self) -> Step | None:
        taken = pack_samples(self.samples, self.fair, self.sample_budget)
        return Step("sample", taken) if taken else None

    def _dequeued(self, w: Work) -> None:
        t = self.fair.tenant(w.tenant)
        t.queued_requests -= w.final
        t.queued_tokens -= w.tokens

    def complete(self, step: Step, seconds: float | None = None) -> None:
        """The step's ops have finished: their models may go on. `seconds`: how long the
        step took (measured by the daemon; None if unknown or it failed), which the cost
        model learns from."""
        if seconds is not None and step.kind == "train" and step.shape is not None:
            self.cost.observe(step.shape, seconds)
        for w in step.work:
            if w.model is not None and w.final and w.model in self.queues:
                self.queues[w.model].in_flight -= 1

    # -- reporting ----------------------------------------------------------------------

    def status(self) -> dict[str, dict]:
        """Per tenant; `share` is its share of all training time, `contended_share` its
        share of the time of steps that left work waiting (None before there was one): the
        split the weights decide. With every tenant's work fitting each step, `share`
        follows what tenants ask, whatever their weights."""
        total = sum(t.served_s for t in self.fair.tenants.values()) or 1.0
        contended = sum(t.contended_s for t in self.fair.tenants.values())
        return {name: {"queued_requests": t.queued_requests, "queued_tokens": t.queued_tokens,
                       "paused": self.admission.held_count(name), "served_tokens": t.served_tokens,
                       "served_s": round(t.served_s, 3), "share": t.served_s / total,
                       "contended_s": round(t.contended_s, 3),
                       "contended_share": t.contended_s / contended if contended else None,
                       "weight": t.weight}
                for name, t in sorted(self.fair.tenants.items())}


__all__ = ["Limits", "Planner", "Step", "TRAIN", "SAMPLE", "Work"]
