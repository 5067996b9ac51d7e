"""The engine core: one loop that plans a step, executes it, and completes it.

`EngineCore.add` queues an operation (in its model's seq_id order); `EngineCore.step` is
the whole life of one step, top to bottom:

  1. plan      the planner picks what runs together (scheduler/planner.py): co-batched
               forward/backward rows of many models, or barriers, or samples (which join
               the workers' running batches for one decode slice: pending_samples.py; a
               "slice" step, between the others, goes on with them);
  2. execute   the executor runs the step's frames on the engine and merges the ranks'
               answers into one outcome per op (executor.py); a small tenant's work
               that arrives meanwhile may join a training step between two of its
               micro-batches, answered when it is done (`_joins`, scheduler/joins.py);
  3. complete  each outcome goes to its future (the pieces of a cut op are merged first),
               residency notes what changed which adapter (completion.py), and the planner
               learns how long the step took.

No HTTP here and no SQL of its own: futures, residency and the executor are composed
objects. Nothing here imports torch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

import msgspec

from scheduler import Planner, Step, Work
from twinkled.core import otel
from twinkled.core.completion import Completion
from twinkled.core.executor import Executor
from twinkled.core.futures import Future, Futures, empty_json
from twinkled.core.gather import Gather
from twinkled.core.metrics import Metrics
from twinkled.core.ops import Op, Outcome, Skip
from twinkled.core.pending_samples import LOST, PendingSamples, Sliced
from twinkled.core.residency import Residency
from twinkled.protocol import trace
from twinkled.protocol.errors import UserError
from twinkled.protocol.frames import SampleF

log = logging.getLogger("twinkled")

# How far ahead of the one a model waits for a seq_id may be (a client's requests in flight).
SEQ_WINDOW = 100_000


class RateLimited(UserError):
    """Over the tenant's quota and the client should come back later (HTTP 429)."""


class EngineCore:
    def __init__(self, planner: Planner, executor: Executor, futures: Futures,
                 residency: Residency, metrics: Metrics, gather_s: float = 0.0,
                 slice_s: float = 0.0, long_slice_s: float = 0.0):
        self.planner = planner
        self.executor = executor
        self.futures = futures
        self.residency = residency
        self.metrics = metrics
        self.wake = asyncio.Event()  # set when work arrives
        self.gather = Gather(planner, residency, metrics, gather_s, self.wake,
                             preemptible=executor.preemptible)
        self.stepping = False
        self._seq_index: dict[tuple[str, int], str] = {}  # (model, seq) -> future id: retries
        self.completion = Completion(futures, residency, metrics, planner.queues)
        # the samples the workers decode across steps
        self.samples = PendingSamples(slice_s, long_slice_s)
        executor.on_restart(self._samples_lost)

    # -- intake ---------------------------------------------------------------------------

    def add(self, op: Op) -> Future:
        """Queue `op`; a repeated (model, seq_id) returns the original future.

        Over its tenant's quota, training work waits (its polls say "paused_rate_limit");
        a sample is refused with RateLimited (429), which the client backs off from."""
        tenant = op.future.tenant
        if isinstance(op.frame, SampleF):
            if self.planner.over_quota(tenant, op.tokens):
                self.futures.drop(op.future, "over the tenant's sampling quota")
                raise RateLimited(f"tenant {tenant!r} is over its queue quota; retry shortly")
        else:
            model = op.model_id
            try:
                original = self.admit(tenant, model, op.seq_id, op.future.kind)
            except UserError as e:
                self.futures.drop(op.future, str(e))
                raise
            if original is not None:  # a retry of a request already taken
                self.futures.drop(op.future, "superseded by the original request")
                return original
            lost = self.executor.take_rollback(model)
            if lost is not None:  # said once, in place of this request, which takes its seq_id
                op = Op(model, op.seq_id, Skip(lost), op.future, after=op.after)
            self._seq_index[(model, op.seq_id)] = op.future.id
            self.futures.bind(op.future, model, op.seq_id)
            self.gather.arrived(model, op.kind)
        self.planner.submit(Work(op.future.id, tenant, op.kind, op.tokens, op.model_id,
                                 op.seq_id, op, parts=op.parts))
        if trace.enabled():
            trace.record("arrive", tenant=tenant, kind=op.kind, tokens=op.tokens, at=time.time())
        self.wake.set()
        if not (isinstance(op.frame, SampleF) and self.samples.backlog):  # (it could run)
            self.executor.nudge()  # a long sampling slice in flight ends at its turn's end
        return op.future

    def admit(self, tenant: str, model: str, seq_id: int, kind: str) -> Future | None:
        """Whether an op of `model` at `seq_id` would be queued, asked before anything is
        recorded for it: the original future if that seq_id was taken (a client's retry:
        the original request, nothing is done again), None if it would be queued; raises
        UserError if it would be refused."""
        if not self.residency.is_open(model):
            raise UserError(f"model {model} is not loaded in this daemon (it was created "
                            "before a restart): create a training client from its last "
                            "checkpoint")
        original = self.original(tenant, model, seq_id, kind)
        if original is not None:
            return original
        message = self._out_of_order(model, seq_id)
        if message is not None:
            raise UserError(message)
        return None

    def original(self, tenant: str, model: str, seq_id: int, kind: str) -> Future | None:
        """The future of the request that took `seq_id` of `model`, if it is still known
        (`kind`: the future kind a retry of it has)."""
        future_id = self._seq_index.get((model, seq_id))
        if future_id is not None:
            return self.futures.find(future_id) or self.futures.get(tenant, future_id)
        next_seq = self.planner.queues.next_seq(model)
        if next_seq is None or self.planner.queues.resyncing(model) or seq_id < next_seq:
            # Restored after a crash (or an old seq_id): the index is gone, the store has
            # it. A retry of an op that ran before the crash must not run it twice.
            return self.futures.taken(tenant, model, seq_id, kind)
        return None

    def _out_of_order(self, model: str, seq: int) -> str | None:
        next_seq = self.planner.queues.next_seq(model)
        if seq < next_seq:
            return f"seq_id {seq} of {model} has already run"
        if seq > next_seq + SEQ_WINDOW and not self.planner.queues.resyncing(model):
            return (f"seq_id {seq} of {model} is too far ahead: the model waits for seq_id "
                    f"{next_seq} (at most {SEQ_WINDOW} ahead)")
        return None

    def lost_before_restart(self, model: str, seq: int, why: str, category: str) -> None:
        """Before the last stop, training forward_backward `seq` of `model` failed (or was
        cut short by the stop) and nothing of the model came after it: the optim_step its
        client sent behind it, resent to this daemon, must not run without its gradients
        (lost_gradients.py)."""
        self.completion.lost_before_restart(model, seq, why, category)

    def refuse(self, tenant: str, model_id: str, seq_id: int | None, why: str) -> None:
        """A request refused at the door still takes its seq_id: the client counts on past
        it, and its later requests must not wait for it forever. (A retried seq_id, one
        already run, or one beyond the window takes nothing.)"""
        if (seq_id is None or not self.residency.is_open(model_id)
                or self.planner.queues.seq_taken(model_id, seq_id)
                or (model_id, seq_id) in self._seq_index
                or self._out_of_order(model_id, seq_id) is not None):
            return
        f = self.futures.new(tenant, "refused", empty_json)
        self.add(Op(model_id, seq_id, Skip(why), f))

    def withdraw(self, f: Future, why: str) -> bool:
        """Take a sample out of the queue, or out of the workers' running batches (at the
        next sampling step), and fail its future with `why`; False if it is done."""
        if f.done.is_set() or not (self.planner.withdraw(f.id, f.tenant)
                                   or self.samples.cancel(f)):
            return False
        self.futures.fail(f, why, "user")
        self.metrics.samples_cancelled.labels(f.tenant).inc()
        self.executor.nudge()  # (its rows leave the running batch at the next step)
        return True

    def idle(self) -> bool:
        """No step is running and nothing queued can run."""
        return not self.stepping and self.planner.idle() and not self.samples.busy

    # -- the loop -------------------------------------------------------------------------

    async def run(self) -> None:
        """Step while there is work; sleep until a request arrives."""
        while True:
            if not self.samples.in_turn():  # (a slice gives the clients that moment anyway)
                await self.gather.wait()
            try:
                stepped = await self.step()
            except Exception:  # a bug: this loop is every tenant's, it must go on
                log.exception("the engine loop could not plan or run a step; it goes on")
                self.stepping = False
                await asyncio.sleep(0.05)  # (not a hot loop if it fails again at once)
                continue
            if not stepped:
                # Idle until a request arrives. The gather's clients are kept: it then
                # gives the last step's other clients (and the optim_step a client POSTs
                # right behind its forward_backward) a moment to join the next step.
                # Measured on an H200 with 8 tenants, dropping that wait after idle cost
                # about 40%.
                await self.wake.wait()
                self.wake.clear()

    async def step(self) -> bool:
        """Plan, execute and complete one step; False if nothing could run."""
        await self.executor.ready()  # a restart after a failed step: plan once it is done
        planning = time.time()
        step = self.planner.next_step(samples=not self.samples.backlog,  # 1. plan
                                      train=not self.samples.in_turn())
        if step is None:
            if not self.samples.busy:
                return False
            await self._sample([])
            return True
        planned = [self._piece_op(w) for w in step.work]
        ops = self._runnable(planned)
        if step.kind == "sample":
            await self._sample(ops)
            self.planner.complete(step)
            self._after(step, None)
            return True
        if step.kind == "train":
            self.samples.end_turn()
        seconds = None  # how long the step took: what the planner's cost model learns
        if ops:
            started, joined = time.monotonic(), self.executor.joined_s
            try:
                executing = time.time()
                outcomes = await self._execute(step, ops)  # 2. execute
                completing = time.time()
                if otel.enabled():  # the ops' step spans (core/otel.py)
                    otel.stepped(self.planner.steps, step.kind, ops, executing, completing)
                self.completion.complete(ops, outcomes)  # 3. complete
                if trace.enabled():
                    trace.record("loop", kind=step.kind, ops=len(ops), planned=planning,
                                 work=sorted({op.kind for op in ops}),
                                 tenants=_tenant_kinds(ops),
                                 executing=executing, completing=completing, done=time.time(),
                                 queued=max(started - op.submitted for op in ops),
                                 predicted=step.predicted_s, micro_tokens=step.micro_tokens,
                                 tokens=step.shape.tokens if step.shape else 0)
                if len(ops) == len(planned) and all(c != "server" for _, _, c in outcomes):
                    # a step that ran whole; what joins took inside it is not its cost
                    seconds = time.monotonic() - started - (self.executor.joined_s - joined)
            except Exception as e:  # never let the loop die: fail what the step held
                log.exception("a %s step failed outside the engine", step.kind)
                self.completion.server_error(ops, e)
        self.planner.complete(step, seconds)
        self._after(step, seconds)
        return True

    def _piece_op(self, w: Work) -> Op:
        """The op a planned piece runs: a cut forward/backward covers some of its datums."""
        op = w.payload
        if w.final and w.lo == 0:
            return op
        part = msgspec.structs.replace(op.frame, data=op.frame.data[w.lo:w.hi])
        return replace(op, frame=part, piece=(w.lo, w.final))  # checked whole at the door

    def _runnable(self, planned: list[Op]) -> list[Op]:
        """What of a planned step goes to the engine: not the pieces of an op that already
        failed (nothing of it trains further), nor requests refused at the door (their
        clients hear why now, in their seq_id's turn: `Completion.answered`)."""
        ops = []
        for op in planned:
            if (op.piece and op.future.done.is_set()) or self.completion.answered(op):
                continue
            if op.seq_id is not None:
                # A retry of a recent request still finds its future; older ones are let go.
                self._seq_index.pop((op.model_id, op.seq_id - 1000), None)
            ops.append(op)
        return ops

    async def _sample(self, ops: list[Op]) -> None:
        """A sampling step: `ops` join the workers' running batches (none: a "slice" step),
        which decode for the rest of sampling's turn, or until a sample finished; what
        finished is completed."""
        # No other work waits (samples the workers have no room for do not count): the
        # slice may run long, ended by a nudge when work arrives (`add`).
        try:
            alone = not self.planner.waiting(samples=not self.samples.backlog)
            frame = self.samples.step(ops, alone)
        except Exception as e:  # a bug: what it would have run fails, the loop goes on
            log.exception("a sampling step could not be built")
            for op in ops:
                self.futures.fail(op.future, f"server error: {type(e).__name__}: {e}", "server")
            return
        self.stepping = True
        self.gather.sampling()
        started, began = time.monotonic(), time.time()
        for op in ops:
            self.metrics.queue_wait.observe(started - op.submitted)
        try:
            sliced = Sliced.of(await self.executor.run_samples(frame))
        except Exception as e:  # a bug: fail what it ran, keep serving
            log.exception("a %s step failed", frame.kind)
            sliced = Sliced(lost=f"server error: {type(e).__name__}: {e}")
        finally:
            self.stepping = False
            self.samples.spent(time.monotonic() - started)
            self.metrics.step_seconds.labels(frame.kind).observe(time.monotonic() - started)
        completing = time.time()
        self.completion.settle(self.samples.settle(sliced))
        if trace.enabled():
            trace.record("loop", kind=frame.kind, ops=len(ops), planned=began, executing=began,
                         completing=completing, done=time.time(),
                         queued=max((started - op.submitted for op in ops), default=0.0))

    def _samples_lost(self, why: str) -> None:
        self.completion.settle(self.samples.lose(LOST.format(why=why)))

    async def _execute(self, step: Step, ops: list[Op]) -> list[Outcome]:
        kind = step.kind
        self.stepping = True
        started = time.monotonic()
        for op in ops:
            self.metrics.queue_wait.observe(started - op.submitted)
        try:
            run = asyncio.ensure_future(self.executor.run_ops(kind, ops, step.micro_tokens))
            if kind == "train" and self.planner.preempt_limit() > 0:
                await self._joins(step, run)
            return await run
        except Exception as e:  # a bug: fail this step, keep serving
            log.exception("step failed")
            return [(None, f"server error: {type(e).__name__}: {e}", "server")] * len(ops)
        finally:
            self.stepping = False
            self.metrics.step_seconds.labels(kind).observe(time.monotonic() - started)

    async def _joins(self, step: Step, run: asyncio.Future) -> None:
        """While training step `step` runs (`run`): each time work arrives, small work of
        other models that may join it (Planner.join_step) is sent in, to run between two
        of its micro-batches; each join is completed when its answer comes, not when the
        step's does. Returns when the step and its joins are done."""
        joins: list[asyncio.Task] = []
        looks = 50  # until the ranks have the step (joins may go in from then on): 0.1 s
        while not run.done():
            if self.executor.can_join():
                looks = 0
                j = self.planner.join_step(step, self._may_join)
                if j is not None:
                    ops = self._runnable([self._piece_op(w) for w in j.work])
                    sent = self.executor.join(ops) if ops else None  # (sent now)
                    joins.append(asyncio.ensure_future(self._joined(j, ops, sent)))
            self.wake.clear()
            woken = asyncio.ensure_future(self.wake.wait())
            # Until the step is sent, look again soon: small work queued before it was
            # planned (a step the flooder's rows filled) joins at its first micro-batch
            # boundary, not only once more work arrives (on the CPU flood trace, the small
            # tenant's slowest steps waited out a whole step so).
            looks = max(0, looks - 1)
            await asyncio.wait([run, woken], timeout=0.002 if looks else None,
                               return_when=asyncio.FIRST_COMPLETED)
            woken.cancel()
        if joins:
            await asyncio.wait(joins)

    def _may_join(self, model: str) -> bool:
        """A pipelining client's forward_backward joins with the optim_step it sends right
        behind it (the gather's view), not without it."""
        return self.executor.may_join(model) and not (
            self.gather.is_paired(model) and self.planner.queues.awaits_barrier(model))

    async def _joined(self, j: Step, ops: list[Op], sent) -> None:
        """A join's answer: its ops completed at once (their clients hear now)."""
        try:
            if sent is not None:
                outcomes = await sent
                self.completion.complete(ops, outcomes)
                if trace.enabled():
                    trace.record("join", tenants=_tenant_kinds(ops), at=time.time())
        except Exception as e:  # a bug: fail what it held, keep serving
            log.exception("a joined step failed")
            self.completion.server_error(ops, e)
        finally:
            self.planner.complete(j)

    def _after(self, step: Step, seconds: float | None) -> None:
        self.completion.unloaded(step)
        self.gather.stepped(step, seconds)


def _tenant_kinds(ops: list[Op]) -> dict[str, list]:
    """{tenant: [kind, tokens]...} of a step's ops (for the trace)."""
    out: dict[str, list] = {}
    for op in ops:
        out.setdefault(op.future.tenant, []).append([op.kind, op.tokens])
    return out
