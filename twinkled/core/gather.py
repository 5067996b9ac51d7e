"""The gather: between two steps, a moment for the clients just served to send more.

They all get their results at once and answer within milliseconds; planning at once would
start a step with the first of them and leave the rest for the next one (each step costs
about the same whatever its rows, on a host-bound card). So the loop waits, up to one
window, until each model the last step served has work again; and for a pipelining model
(`paired`: its client sends an optim_step right behind each forward_backward, as tinker's
does) whose forward_backward is in, for that optim_step too: a window from the
forward_backward's arrival, up to `HALF_PAIR_WINDOWS` in all, and only while it is worth
it. Planning without the optim_step runs it at the end of the next step (or in a barrier
step of its own when rows wait behind it), and that model's next rows miss the next step:
about `halves / rows` of a step's work lost, against the wait, which idles every rank.
Through HTTP on 4 GPUs, half the steps were once such barrier steps, each costing 11 ms
plus a gather of 20 to 40 ms.

Next to other work ready to run (a flooder's backlog), on a group whose steps are
preemptible (scheduler/joins.py), there is no gather: the waited-for clients' requests join
the step in flight between its micro-batches, and idling the ranks for them was where a
flooder's throughput went (measured on the CPU: 16% of the time next to a small tenant).
"""

from __future__ import annotations

import asyncio
import time

from scheduler import OPTIM, TRAIN, Planner, Step
from twinkled.core.metrics import Metrics
from twinkled.core.residency import Residency
from twinkled.protocol import trace

# How long the gather may wait in all for the optim_step of a pair half in, in windows.
HALF_PAIR_WINDOWS = 3


class Gather:
    def __init__(self, planner: Planner, residency: Residency, metrics: Metrics,
                 window_s: float, wake: asyncio.Event, preemptible: bool = False):
        self.planner = planner
        self.residency = residency
        self.metrics = metrics
        self.window_s = window_s
        self.wake = wake  # set by the core when work arrives
        self.preemptible = preemptible  # the group's training steps may take joins
        self._recent: set[str] = set()  # the models the last step served
        # Models whose client sends an optim_step right behind each forward_backward (seen
        # arriving while the work ahead of it was queued or running, or riding in the same
        # step as its rows). A model whose forward_backward follows another one (gradient
        # accumulation) is dropped until an optim_step rides behind its rows again; a slow
        # client is not: it was slow once.
        self._paired: set[str] = set()
        self._latest: dict[str, tuple[str, float]] = {}  # model -> its latest op's kind, arrival
        self._train_s = window_s  # the last training step's seconds (the worth of a wait)

    def arrived(self, model: str, kind: str) -> None:
        """A training op of `model` is in (called before the planner queues it)."""
        if kind == OPTIM and self.planner.queues.busy(model):
            # Sent before the forward_backward ahead of it finished: a pipelining client.
            self._paired.add(model)
        elif kind == TRAIN and self._latest.get(model, ("",))[0] == TRAIN:
            self._paired.discard(model)  # accumulating gradients: no optim_step behind
        self._latest[model] = (kind, time.monotonic())

    def is_paired(self, model: str) -> bool:
        """Whether `model`'s client is taken to send an optim_step right behind each
        forward_backward (so a gather after its rows waits for it)."""
        return model in self._paired

    def stepped(self, step: Step, seconds: float | None = None) -> None:
        """A step ran (in `seconds`, if whole): its clients are the next gather's to wait for."""
        for w in step.work:
            if w.kind == "unload":
                self._latest.pop(w.model, None)
                self._paired.discard(w.model)
        self._recent = {w.model for w in step.work if w.model is not None and w.kind != "unload"}
        if step.kind == "train" and seconds is not None:
            self._train_s = seconds
        if step.kind == "train":  # an optim_step that came in time to ride behind its rows
            rows = {w.model for w in step.work if w.kind == TRAIN}
            self._paired |= {w.model for w in step.work if w.kind == OPTIM and w.model in rows}

    def sampling(self) -> None:
        """A sampling step runs: its clients answer on their own time (no gather after it)."""
        self._recent = set()

    async def wait(self) -> None:
        """The gather itself (see the module's docstring)."""
        window = self.window_s
        halves = {m for m in self._paired if self._half_pair(m)}
        recent = self._recent | halves  # halves: also models a step left out (stragglers)
        if not recent or window <= 0 or self._joinable(recent):
            return
        began = time.monotonic()
        try:
            await self._await_clients(recent, began, began + window)
        finally:
            self.metrics.gather_wait.observe(time.monotonic() - began)
            if trace.enabled():
                trace.record("gather", waited=time.monotonic() - began, at=time.time())

    async def _await_clients(self, recent: set[str], began: float, deadline: float) -> None:
        """Wait until no model of `recent` is waited for (`_waiting_for`), or the deadline;
        past it, only for the optim_steps of the pairs half in (`_half_pairs_until`).
        Monotonic seconds (`_latest` records arrivals so)."""
        while waiting := self._waiting_for(recent):
            now = time.monotonic()
            until = deadline
            if now >= deadline:  # past the window: only for the pairs half in
                halves = {m for m in waiting if self.planner.queues.has_pending(m)}
                until = self._half_pairs_until(halves, began)
                if now >= until:
                    return
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), until - now)
            except TimeoutError:
                pass
        await asyncio.sleep(min(0.002, max(0.0, deadline - time.monotonic())))

    def _joinable(self, recent: set[str]) -> bool:
        """Other work is ready, and what `recent`'s clients send next may join the step
        it makes (see the module's docstring)."""
        if not self.preemptible or self.planner.preempt_limit() <= 0:
            return False
        waited = sum(1 for m in recent if self.planner.queues.has_pending(m))
        return self.planner.queues.with_work() > waited

    def _half_pairs_until(self, halves: set[str], began: float) -> float:
        """How long the optim_steps of `halves` are worth waiting for: a window from the
        latest of their forward_backwards, at most `HALF_PAIR_WINDOWS` windows in all, and
        no longer than the share of a step their models' next rows would lose
        (halves / models with work, of the last training step's time)."""
        if not halves:
            return began
        arrived = max((self._latest[m][1] for m in halves if m in self._latest), default=began)
        worth = len(halves) / max(1, self.planner.queues.with_work()) * self._train_s
        return min(began + HALF_PAIR_WINDOWS * self.window_s, arrived + self.window_s,
                   began + max(self.window_s, worth))

    def _waiting_for(self, recent: set[str]) -> set[str]:
        """The models of `recent` whose client has not sent its next request yet (or the
        optim_step it sends right behind its forward_backward)."""
        return {m for m in recent if self.residency.is_open(m)
                and (not self.planner.queues.has_pending(m)
                     or (m in self._paired and self._half_pair(m)))}

    def _half_pair(self, model: str) -> bool:
        """A paired model whose forward_backward is in and whose optim_step is not yet, and
        could still ride behind its rows in the next step (Planner.optim_may_ride). With
        more rows queued than a step takes (a flooder keeping several large requests in
        flight) it could not: measured on the CPU, waiting for it anyway idled the worker a
        whole window before every step (a third of the flooder's throughput) and made a
        small tenant's request, already in, wait out the rest of the window."""
        return self.planner.queues.awaits_barrier(model) and self.planner.optim_may_ride(model)
