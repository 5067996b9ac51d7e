"""What a request does, independent of the wire protocol.

The service owns the futures that clients poll and feeds the scheduler's planned steps
to the worker group (through `WorkerClient`), one step at a time. Operations of one model
run in `seq_id` order, whatever order they arrive in; forward/backward requests of several
models that are ready together run as ONE co-batched step. Nothing here imports torch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec

from scheduler import Limits, Planner, Work

from .config import Config
from .engine.checks import Limits as RequestLimits
from .futures import Encoder, Future, FutureBook, NotFound, UserError  # noqa: F401
from .metrics import Metrics
from .residency import Residency
from .verify import verify_checkpoints
from .worker_client import WorkerClient
from .workers.frames import CreateF, LoadF, OpF, SampleF, TrainF, UnloadF, kind_of

log = logging.getLogger("twinkled")


class Skip(msgspec.Struct, tag="skip"):
    """A request refused at the door, queued only to take its seq_id: its client hears why."""

    why: str


# What a finished op's result is handed to, with its error message (None if it ran): the
# store's side of a save, for instance.
After = Callable[[Any, str | None], None]


@dataclass
class Op:
    """One queued operation of a model (or of a sampler: seq_id None, no ordering). `frame`
    is the typed message the workers run (workers/frames.py), built and checked at the door."""

    model_id: str | None
    seq_id: int | None
    frame: OpF | Skip
    future: Future
    tokens: int = 0  # what it costs its tenant's share (rows' tokens; 0 for barriers)
    parts: list[int] | None = None  # a forward_backward's datum sizes: where it may be cut
    after: After | None = None
    piece: tuple[int, bool] | None = None  # (first datum, last piece?) of a cut op
    submitted: float = field(default_factory=time.monotonic)  # for the queue-wait metric

    @property
    def kind(self) -> str:
        return kind_of(self.frame)


# How far ahead of the one a model waits for a seq_id may be (a client's requests in flight).
SEQ_WINDOW = 100_000


def _ms(seconds: float) -> float | None:
    return round(seconds * 1e3, 1) if seconds < float("inf") else None


class RateLimited(UserError):
    """Over the tenant's quota and the client should come back later (HTTP 429)."""


class Draining(Exception):
    """The daemon is stopping (hot restart): come back shortly (HTTP 503, retried)."""


class Service(FutureBook, Residency):
    def __init__(self, config: Config, store):
        self.config = config
        self.store = store
        self.workers = WorkerClient(config)
        self.state = "loading"
        self.load_error: str | None = None
        self.futures: dict[str, Future] = {}
        self.seq_index: dict[tuple[str, int], str] = {}  # (model, seq) -> future id: retries
        self.planner = Planner(config.token_budget, config.sample_budget, config.target_step_s)
        self.wake = asyncio.Event()
        self._pieces: dict[str, list] = {}  # future id -> results of a cut op's pieces
        self._task: asyncio.Task | None = None
        self._stepping = False
        self.stopping = asyncio.Event()  # set at shutdown: long polls return at once
        self.intake_paused = False  # `twinkled ctl drain`: new work gets a 503
        self.metrics = Metrics(self)
        self._model_locks: dict[str, asyncio.Lock] = {}  # idle unload vs reload of a model
        self.workers.on_restart = self.metrics.worker_restarts.inc
        self.damaged: list[dict] = []  # checkpoints found damaged at start-up
        self._limits: RequestLimits | None = None
        self._limits_from: dict | None = None

    # -- life cycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Start the workers (they load the model); the HTTP server answers meanwhile.

        Work cut short by the last stop is settled first: its futures fail with a clear
        error when polled, and half-written checkpoints are marked and never served."""
        failed = self.store.fail_pending_futures(
            "the daemon restarted before this request finished; submit it again")
        for c in self.store.abandon_writing_checkpoints("the daemon stopped while writing it"):
            log.warning("checkpoint %s was cut short by a stop; marked corrupt", c["tinker_path"])
        if failed:
            log.warning("%d requests were cut short by the last stop", failed)
        self._advertise()
        loop = asyncio.get_running_loop()
        # Hashing can take a while on a big data dir: in a thread, while the workers load
        # the model and the HTTP server answers; no step runs before it is done.
        self._verified = loop.run_in_executor(None, verify_checkpoints, self.store,
                                              self.config.data_dir)
        self._task = loop.create_task(self._run())
        self._janitor = loop.create_task(self._housekeeping())

    def _advertise(self) -> None:
        """<data_dir>/daemon.json tells `twinkled ctl` where this daemon answers."""
        import os

        host = self.config.host if self.config.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        info = {"url": f"http://{host}:{self.config.port}", "pid": os.getpid()}
        (self.config.data_dir / "daemon.json").write_text(json.dumps(info))

    async def _housekeeping(self, every: float = 2.0) -> None:
        """Tenant settings and the status row every few seconds; old results and expired
        checkpoints every minute."""
        import shutil

        ticks = 0
        while True:
            try:
                self.refresh_tenants()
                self.store.put_status(self.status())
                await self._unload_idle()
                if ticks % 30 == 0:
                    self.purge_futures()
                    for c in self.store.expired_checkpoints():
                        self.store.delete_checkpoint(c["tinker_path"])
                        shutil.rmtree(c["dir"], ignore_errors=True)
                        log.info("checkpoint %s expired and was deleted", c["tinker_path"])
            except Exception:  # housekeeping must never take the daemon down
                log.exception("housekeeping failed")
            ticks += 1
            await asyncio.sleep(every)

    def status(self) -> dict:
        return {"model": self.config.served_name, "state": self.state,
                "devices": self.workers.group.devices, "steps": self.planner.steps,
                "adapters": len(self.planner.models), "tenants": self.planner.status(),
                "step_target_ms": _ms(self.planner.step_target()),  # None: no time bound
                "step_cost": self.planner.cost.describe(),
                **self.workers.status(), "damaged_checkpoints": self.damaged,
                "time": time.time()}

    @property
    def health(self) -> str:
        """healthz's status: "ok" when requests run now ("restarting" while workers do)."""
        if self.state == "ready" and self.workers.recovering:
            return "restarting"
        if self.state == "ready" and self.intake_paused:
            return "draining"
        return "ok" if self.state == "ready" else self.state

    @property
    def model_info(self) -> dict:
        return self.workers.model_info

    @property
    def limits(self) -> RequestLimits:
        """What one request may ask (`engine/checks.py`), checked at the door: the config's
        limits and the model's numbers (the workers' once loaded, config.json's until then)."""
        info = self.model_info or self.config.model_config
        if self._limits is None or self._limits_from is not info:
            self._limits, self._limits_from = self.config.request_limits(info), info
        return self._limits

    async def _load(self) -> None:
        """Start the worker group (it loads the model) and bring back the live adapters."""
        try:
            await self.workers.start()
            await self._restore_runs()
            self._watch = asyncio.get_running_loop().create_task(self.workers.watch())
            self.state = "ready"
            log.info("model %s loaded", self.config.served_name)
        except Exception as e:  # the daemon keeps answering healthz with the reason
            self.state, self.load_error = "failed", f"{type(e).__name__}: {e}"
            log.exception("model load failed")

    async def shutdown(self) -> None:
        """SIGTERM: stop taking work, let queued work run (up to `drain_timeout_s`), fail
        the rest, persist every live adapter with its optimizer state, stop the workers."""
        self.state = "draining"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_timeout_s
        while (self._stepping or not self.planner.idle()) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for task in (self._task, getattr(self, "_watch", None)):
            if task:
                task.cancel()
        for f in list(self.futures.values()):
            if not f.done.is_set():
                self.fail(f, "the daemon was stopped (restarted) before this request ran; "
                          "submit it again", "server")
        self.stopping.set()
        if self.load_error is None and self.workers.group.model_info:
            try:
                await self.workers.persist_all()
                for model, q in self.planner.models.items():
                    self.store.set_run_live(model, True, next_seq=q.next_seq)
                log.info("persisted %d live adapter(s)", len(self.workers.live))
            except Exception:
                log.exception("persisting live adapters at shutdown failed")
        await self.workers.stop()
        (self.config.data_dir / "daemon.json").unlink(missing_ok=True)
        log.info("workers stopped; closing connections")

    async def drain(self, timeout: float = 600.0, undo: bool = False) -> dict:
        """Stop taking new work and wait (up to `timeout`) until nothing queued can run."""
        self.intake_paused = not undo
        if undo:
            return {"drained": False, "queued": 0}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (self._stepping or not self.planner.idle()) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        queued = sum(t["queued_requests"] for t in self.planner.status().values())
        return {"drained": not self._stepping and self.planner.idle(), "queued": queued}

    async def close(self) -> None:
        for task in (self._task, getattr(self, "_janitor", None), getattr(self, "_watch", None)):
            if task:
                task.cancel()
        if self.state != "draining":
            await self.workers.stop()

    # -- submitting -------------------------------------------------------------------

    def submit(self, op: Op) -> Future:
        """Queue `op`; a repeated (model, seq_id) returns the original future.

        Over its tenant's quota, training work waits (its polls say "paused_rate_limit");
        a sample is refused with RateLimited (429), which the client backs off from."""
        if self.state == "failed":
            raise UserError(f"the model failed to load: {self.load_error}")
        if self.state == "draining" or self.intake_paused:
            self._drop(op.future, "the daemon is draining")
            raise Draining("the daemon is draining for maintenance or a restart; retry shortly")
        tenant = op.future.tenant
        if isinstance(op.frame, SampleF):
            if self.planner.over_quota(tenant, op.tokens):
                self._drop(op.future, "over the tenant's sampling quota")
                raise RateLimited(f"tenant {tenant!r} is over its queue quota; retry shortly")
        else:
            if op.model_id not in self.planner.models:
                self._drop(op.future, "model not loaded")
                raise UserError(f"model {op.model_id} is not loaded in this daemon (it was "
                                "created before a restart): create a training client from "
                                "its last checkpoint")
            lost = self.workers.take_rollback(op.model_id)
            if lost is not None:  # said once, in place of this request, which takes its seq_id
                op = Op(op.model_id, op.seq_id, Skip(lost), op.future)
            key = (op.model_id, op.seq_id)
            if key in self.seq_index:  # a retry of a request already taken
                self._drop(op.future, "superseded by the original request")
                return self.futures[self.seq_index[key]]
            q = self.planner.models[op.model_id]
            if op.seq_id < q.next_seq:
                message = f"seq_id {op.seq_id} of {op.model_id} has already run"
                self._drop(op.future, message)
                raise UserError(message)
            if op.seq_id > q.next_seq + SEQ_WINDOW and not q.resync:
                message = (f"seq_id {op.seq_id} of {op.model_id} is too far ahead: the model "
                           f"waits for seq_id {q.next_seq} (at most {SEQ_WINDOW} ahead)")
                self._drop(op.future, message)
                raise UserError(message)
            self.seq_index[key] = op.future.id
        self.planner.submit(Work(op.future.id, tenant, op.kind, op.tokens, op.model_id,
                                 op.seq_id, op, parts=op.parts))
        self.wake.set()
        return op.future

    def refuse(self, tenant: str, model_id: str, seq_id: int | None, why: str) -> None:
        """A request refused at the door still takes its seq_id: the client counts on past
        it, and its later requests must not wait for it forever. (A retried seq_id, one
        already run, or one beyond the window takes nothing.)"""
        q = self.planner.models.get(model_id)
        if (q is None or seq_id is None or seq_id < q.next_seq or seq_id in q.pending
                or (model_id, seq_id) in self.seq_index
                or (seq_id > q.next_seq + SEQ_WINDOW and not q.resync)):
            return
        f = self.new_future(tenant, "refused", lambda _: (b"{}", "application/json"))
        self.submit(Op(model_id, seq_id, Skip(why), f))

    def _drop(self, f: Future, why: str) -> None:
        self.futures.pop(f.id, None)
        self.store.fail_future(f.id, why, "user")

    def is_paused(self, future_id: str) -> bool:
        return future_id in self.planner.paused

    def open_model(self, model_id: str, tenant: str, first_seq: int = 1) -> None:
        self.planner.open_model(model_id, tenant, first_seq)

    def unload_models(self, tenant: str, model_ids: list[str]) -> None:
        """Free the adapters of a finished session, after whatever they still have queued.

        Their runs and checkpoints stay; a training client can be made again from a
        checkpoint. A request that still names such a model gets a clear 400."""
        for model in model_ids:
            q = self.planner.models.get(model)
            if q is None:
                continue
            seq = max([q.next_seq - 1, *q.pending]) + 1
            f = self.new_future(tenant, "unload", lambda _: (b"{}", "application/json"))
            self.submit(Op(model, seq, UnloadF(model), f))

    def check_new_adapter(self, tenant: str, rank: int) -> None:
        """Quotas on adapters and rank: a clear refusal, not a wait."""
        lim = self.planner.tenant(tenant).limits
        if lim.max_rank is not None and rank > lim.max_rank:
            raise UserError(f"rank {rank} is over tenant {tenant!r}'s cap of {lim.max_rank}")
        if lim.max_adapters is not None:
            mine = sum(t == tenant for t in self.planner.model_tenant.values())
            if mine >= lim.max_adapters:
                raise UserError(f"tenant {tenant!r} already has {mine} adapters, its quota")

    def refresh_tenants(self) -> None:
        """Weights and quotas: the store's (`twinkled ctl tenants set`) over the config's."""
        cfg = self.config
        for row in self.store.list_tenants():
            base = dict(cfg.tenants.get(row["name"], {}))
            weight = row["weight"] if row["weight"] != 1.0 else base.pop("weight", 1.0)
            base.pop("weight", None)
            limits = {k: row.get(k) or base.get(k) or getattr(cfg, f"tenant_{k}")
                      for k in self.store.TENANT_LIMITS}
            self.planner.set_tenant(row["name"], float(weight), Limits(**limits))

    def _merge_piece(self, op: Op, result, message, category):
        """Collect the pieces of a cut forward/backward; the last one gives the result."""
        _, final = op.piece
        parts = self._pieces.setdefault(op.future.id, [])
        if message is not None:
            self._pieces.pop(op.future.id, None)
            return None, message, category
        parts.append(result)
        if not final:
            return None, None, None
        self._pieces.pop(op.future.id, None)
        merged = type(result)(outputs=[o for r in parts for o in r.outputs], metrics={})
        for r in parts:
            for k, v in r.metrics.items():
                merged.metrics[k] = merged.metrics.get(k, 0.0) + v if k.endswith(":sum") else v
        return merged, None, None

    # -- the engine loop --------------------------------------------------------------

    async def _run(self) -> None:
        await self._load()
        try:
            self.damaged = await self._verified
        except Exception:  # a verification bug must not stop the daemon from serving
            log.exception("verifying checkpoints failed")
        recent: set[str] = set()
        while True:
            await self._wait_for_clients(recent)
            step = self.planner.next_step()
            if step is None:
                # Idle until a request arrives. `recent` is kept: the wait above then gives
                # the last step's other clients (and the optim_step a client POSTs right
                # behind its forward_backward) a moment to join the next step. Measured on
                # an H200 with 8 tenants, dropping that wait after idle cost about 40%.
                await self.wake.wait()
                self.wake.clear()
                continue
            seconds = None  # how long the step took: what the planner's cost model learns
            try:
                seconds = await self._execute(step.kind, [self._piece_op(w) for w in step.work])
            except Exception as e:  # never let the loop die: fail what the step held
                log.exception("a %s step failed outside the engine", step.kind)
                for w in step.work:
                    if not w.payload.future.done.is_set():
                        self.fail(w.payload.future, f"server error: {type(e).__name__}: {e}",
                                  "server")
            self.planner.complete(step, seconds)
            for w in step.work:
                if w.kind == "unload":
                    self.planner.forget_model(w.model)
            recent = {w.model for w in step.work if w.model is not None and w.kind != "unload"}

    async def _wait_for_clients(self, recent: set[str]) -> None:
        """Give the clients served by the last step a moment to send their next request.

        They all get their results at once and answer within milliseconds; planning at
        once would start a step with the first of them and leave the rest for the next
        one (each step costs about the same whatever its rows, on a host-bound card). So
        wait, up to `gather_ms`, until each of those models has work again, then a little
        more for the optim_step a client sends right behind its forward_backward."""
        window = self.config.gather_ms / 1000
        if not recent or window <= 0:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + window
        models = self.planner.models
        while any(m in models and not models[m].pending for m in recent):
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), remaining)
            except TimeoutError:
                return
        await asyncio.sleep(min(0.002, max(0.0, deadline - loop.time())))

    def _piece_op(self, w: Work) -> Op:
        """The op a planned piece runs: a cut forward/backward covers some of its datums."""
        op = w.payload
        if w.final and w.lo == 0:
            return op
        part = msgspec.structs.replace(op.frame, data=op.frame.data[w.lo:w.hi])
        return replace(op, frame=part, piece=(w.lo, w.final))  # checked whole at the door

    async def _execute(self, kind: str, batch: list[Op]) -> float | None:
        """Run a step; returns its seconds (the workers' and the handling of its results:
        until the next step may start), None if it did not run whole (an op dropped or
        failed by the server: its time says nothing of the step's cost)."""
        planned = len(batch)
        # Pieces of an op that already failed are dropped (nothing of it trains further).
        batch = [op for op in batch if not (op.piece and op.future.done.is_set())]
        for op in [op for op in batch if isinstance(op.frame, Skip)]:  # refused at the door
            self.fail(op.future, op.frame.why, "user")
        batch = [op for op in batch if not isinstance(op.frame, Skip)]
        if not batch:
            return None
        for op in batch:
            if op.seq_id is not None:
                # A retry of a recent request still finds its future; older ones are let go.
                self.seq_index.pop((op.model_id, op.seq_id - 1000), None)
        self._stepping = True
        started = time.monotonic()
        for op in batch:
            self.metrics.queue_wait.observe(started - op.submitted)
        try:
            outcomes = await self.workers.run_ops(kind, batch)
        except Exception as e:  # a bug: fail this step, keep serving
            log.exception("step failed")
            outcomes = [(None, f"server error: {type(e).__name__}: {e}", "server")] * len(batch)
        finally:
            self._stepping = False
            self.metrics.step_seconds.labels(kind).observe(time.monotonic() - started)
        for op, (result, message, category) in zip(batch, outcomes, strict=True):
            self._track_live(op, message)
            self._count_tokens(op, result, message)
            if op.piece is not None:
                result, message, category = self._merge_piece(op, result, message, category)
                if result is None and message is None:
                    continue  # more pieces to come
            if op.future.done.is_set():
                continue  # an earlier piece already failed it
            if message is None:
                self.resolve(op.future, result)
            else:
                self.fail(op.future, message, category)
            if op.after is not None:
                op.after(result, message)
        whole = len(batch) == planned and all(c != "server" for _, _, c in outcomes)
        return time.monotonic() - started if whole else None

    def _count_tokens(self, op: Op, result, message: str | None) -> None:
        if message is not None:
            return
        tenant = op.future.tenant
        if isinstance(op.frame, TrainF):
            rows = op.frame.data
            self.metrics.tokens_trained.labels(tenant).inc(sum(d.tokens.shape[0] for d in rows))
        elif isinstance(op.frame, SampleF):
            made = sum(len(s.tokens) for s in result.sequences)
            self.metrics.tokens_sampled.labels(tenant).inc(made)

    def _track_live(self, op: Op, message: str | None) -> None:
        """The store knows which adapters are live, so a restart brings them back."""
        if isinstance(op.frame, CreateF | LoadF) and message is None:
            self.store.set_run_live(op.model_id, True)
        elif isinstance(op.frame, UnloadF):
            self.store.set_run_live(op.model_id, False)
