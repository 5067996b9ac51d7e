"""What becomes of an op once its step is over (the engine core's third part: engine_core.py).

Each outcome goes to its future (the pieces of a cut op are merged first: pieces.py),
residency notes what changed which adapter, the tenant's tokens are counted, and a training
forward_backward that failed takes the optim_step queued behind it down too
(lost_gradients.py). The ops a planned step holds that must not run (refused at the door,
or an optim_step whose gradients were lost) are answered here too, in their turn.

Torch-free, like the rest of the core: futures, residency and the metrics are composed in.
"""

from __future__ import annotations

from scheduler import Step
from scheduler.queues import ModelQueues
from twinkled.core.futures import Futures
from twinkled.core.lost_gradients import LostGradients
from twinkled.core.metrics import Metrics
from twinkled.core.ops import Op, Outcome, Skip
from twinkled.core.pieces import Pieces
from twinkled.core.residency import Residency
from twinkled.protocol.frames import OptimF, SampleF, TrainF, changes_adapter


class Completion:
    def __init__(self, futures: Futures, residency: Residency, metrics: Metrics,
                 queues: ModelQueues):
        self.futures = futures
        self.residency = residency
        self.metrics = metrics
        self.queues = queues  # the planner's (what a failed forward_backward was sent with)
        self._lost = LostGradients()  # optim_steps queued behind a failed forward_backward
        self._pieces = Pieces()

    def lost_before_restart(self, model: str, seq: int, why: str, category: str) -> None:
        """Training forward_backward `seq` of `model` failed before the last stop, and
        nothing of the model came after it (EngineCore.lost_before_restart)."""
        self._lost.failed(model, seq, seq, why, category)

    def answered(self, op: Op) -> bool:
        """Whether `op` was answered without running: a request refused at the door (its
        client hears why now, in its seq_id's turn), or an optim_step behind a failed
        forward_backward."""
        if isinstance(op.frame, Skip):
            self.futures.fail(op.future, op.frame.why, "user")
            if op.after is not None:  # a save in its place: its row is not written
                op.after(None, op.frame.why)
            return True
        if isinstance(op.frame, OptimF) and (
                lost := self._lost.check(op.model_id, op.seq_id)) is not None:
            self.futures.fail(op.future, *lost)
            return True
        return False

    def complete(self, ops: list[Op], outcomes: list[Outcome]) -> None:
        with self.futures.settling():  # one store commit for the step's results
            for op, outcome in zip(ops, outcomes, strict=True):
                self._settle_one(op, outcome)

    def settle(self, done: list[tuple[Op, Outcome]]) -> None:
        """`complete` of (op, outcome) pairs (the samples a slice finished)."""
        if done:
            self.complete([op for op, _ in done], [outcome for _, outcome in done])

    def server_error(self, ops: list[Op], e: Exception) -> None:
        """A bug outside the engine: what `ops` held and is not answered yet fails."""
        for op in ops:
            if not op.future.done.is_set():
                self.futures.fail(op.future, f"server error: {type(e).__name__}: {e}", "server")

    def unloaded(self, step: Step) -> None:
        """The models `step` unloaded: closed, and their failed gradients forgotten."""
        for w in step.work:
            if w.kind == "unload":
                self.residency.close(w.model)
                self._lost.forget(w.model)

    def _settle_one(self, op: Op, outcome: Outcome) -> None:
        self.residency.note(op.frame, outcome)
        self._count_tokens(op, outcome)
        self._note_gradients(op, outcome)
        if op.piece is not None:
            outcome = self._pieces.add(op, outcome)
            if outcome is None:
                return  # more pieces to come
        if op.future.done.is_set():
            return  # an earlier piece already failed it
        result, message, category = outcome
        if message is None:
            self.futures.resolve(op.future, result)
        else:
            self.futures.fail(op.future, message, category)
        if op.after is not None:
            op.after(result, message)

    def _note_gradients(self, op: Op, outcome: Outcome) -> None:
        """A training forward_backward (or a piece of one) that failed takes the optim_step
        queued behind it down too (lost_gradients.py)."""
        if op.seq_id is None:
            return
        if isinstance(op.frame, OptimF):
            self._lost.settled(op.model_id, op.seq_id)
        elif isinstance(op.frame, TrainF) and changes_adapter(op.frame):
            if outcome[1] is None:
                self._lost.trained(op.model_id, op.seq_id)
                return
            last = self.queues.seq_after_queued(op.model_id) - 1
            self._lost.failed(op.model_id, op.seq_id, last, outcome[1], outcome[2] or "server")

    def _count_tokens(self, op: Op, outcome: Outcome) -> None:
        result, message, _ = outcome
        if message is not None:
            return
        tenant = op.future.tenant
        if isinstance(op.frame, TrainF):
            rows = op.frame.data
            self.metrics.tokens_trained.labels(tenant).inc(sum(d.tokens.shape[0] for d in rows))
        elif isinstance(op.frame, SampleF):
            made = sum(len(s.tokens) for s in result.sequences)
            self.metrics.tokens_sampled.labels(tenant).inc(made)
            cached = result.cached_tokens
            self.metrics.prompt_tokens.labels(tenant, "cached").inc(cached)
            self.metrics.prompt_tokens.labels(tenant, "prefilled").inc(
                op.frame.prompt.shape[0] - cached)
