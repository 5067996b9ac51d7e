"""What a request does, independent of the wire protocol.

The service owns the engine (run in one dedicated thread so the event loop never blocks),
the per-model ordering of operations, and the futures that clients poll. Operations of one
model run in `seq_id` order, whatever order they arrive in; forward/backward requests of
different models that are ready together run as ONE co-batched engine call (first come,
first served; fair sharing is the scheduler's job, a later step).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .config import Config

log = logging.getLogger("twinkled")

# encode(result) -> (payload bytes, content type); chosen by the protocol layer at submit.
Encoder = Callable[[Any], tuple[bytes, str]]


class UserError(ValueError):
    """The client's fault: answered as a 4xx at submit, or as category "user" later."""


class NotFound(UserError):
    pass


@dataclass
class Future:
    id: str
    tenant: str
    kind: str
    encode: Encoder
    done: asyncio.Event = field(default_factory=asyncio.Event)
    payload: bytes | None = None
    content_type: str = "application/json"
    error: tuple[str, str] | None = None  # (message, category)
    completed_at: float | None = None


@dataclass
class Op:
    """One queued engine operation of a model (or a sampler: seq_id None, no ordering)."""

    kind: str  # "fwdbwd" | "optim" | "save" | "load" | "sample"
    model_id: str | None
    seq_id: int | None
    args: dict
    future: Future


class Service:
    def __init__(self, config: Config, store):
        self.config = config
        self.store = store
        self.engine = None
        self.state = "loading"
        self.load_error: str | None = None
        self.futures: dict[str, Future] = {}
        self.seq_index: dict[tuple[str, int], str] = {}  # (model, seq) -> future id: retries
        self.next_seq: dict[str, int] = {}  # model id -> the seq_id it runs next
        self.queue: dict[str, dict[int, Op]] = {}  # model id -> seq_id -> op
        self.samples: list[Op] = []
        self.wake = asyncio.Event()
        self._last_was_training = False
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._task: asyncio.Task | None = None

    # -- life cycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Load the model in the engine thread; the HTTP server answers meanwhile.

        Work cut short by the last stop is settled first: its futures fail with a clear
        error when polled, and half-written checkpoints are marked and never served."""
        failed = self.store.fail_pending_futures(
            "the daemon restarted before this request finished; submit it again")
        for c in self.store.abandon_writing_checkpoints("the daemon stopped while writing it"):
            log.warning("checkpoint %s was cut short by a stop; marked corrupt", c["tinker_path"])
        if failed:
            log.warning("%d requests were cut short by the last stop", failed)
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run())
        self._janitor = loop.create_task(self._housekeeping())

    async def _housekeeping(self, every: float = 60.0) -> None:
        """Forget old results and delete checkpoints whose TTL has passed."""
        import shutil

        while True:
            await asyncio.sleep(every)
            try:
                self.purge_futures()
                for c in self.store.expired_checkpoints():
                    self.store.delete_checkpoint(c["tinker_path"])
                    shutil.rmtree(c["dir"], ignore_errors=True)
                    log.info("checkpoint %s expired and was deleted", c["tinker_path"])
            except Exception:  # housekeeping must never take the daemon down
                log.exception("housekeeping failed")

    async def _load(self) -> None:
        def load():
            from .engine import Engine

            cfg = self.config
            dtype = cfg.dtype
            device = cfg.resolved_device()
            if device == "cpu" and dtype == "bfloat16":
                dtype = "float32"  # bf16 matmuls on a CPU are slow and gain nothing here
            return Engine(cfg.model, dtype=dtype, device=device, max_rank=cfg.max_rank,
                          token_budget=cfg.token_budget)

        try:
            self.engine = await self._in_engine(load)
            self.state = "ready"
            log.info("model %s loaded", self.config.served_name)
        except Exception as e:  # the daemon keeps answering healthz with the reason
            self.state, self.load_error = "failed", f"{type(e).__name__}: {e}"
            log.exception("model load failed")

    async def close(self) -> None:
        for task in (self._task, getattr(self, "_janitor", None)):
            if task:
                task.cancel()
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def _in_engine(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # -- futures ----------------------------------------------------------------------

    def new_future(self, tenant: str, kind: str, encode: Encoder) -> Future:
        f = Future(f"req-{uuid.uuid4().hex}", tenant, kind, encode)
        self.futures[f.id] = f
        self.store.create_future(f.id, tenant, kind)
        return f

    def resolve(self, f: Future, result: Any) -> None:
        try:
            f.payload, f.content_type = f.encode(result)
        except Exception as e:  # an encoder bug must not leave the client polling forever
            log.exception("encoding a %s result failed", f.kind)
            return self.fail(f, f"server error encoding the result: {e}", "server")
        f.completed_at = time.time()
        self.store.complete_future(f.id, f.payload, f.content_type)
        f.done.set()

    def fail(self, f: Future, message: str, category: str) -> None:
        f.error = (message, category)
        f.completed_at = time.time()
        self.store.fail_future(f.id, message, category)
        f.done.set()

    def get_future(self, tenant: str, future_id: str) -> Future:
        """A live future, or one from before a restart (read back from the store)."""
        f = self.futures.get(future_id)
        if f is None:
            row = self.store.get_future(future_id)
            if row is not None and row["status"] != "pending":
                f = Future(row["id"], row["tenant"], row["kind"], encode=None)
                f.payload, f.content_type = row["result"], row["content_type"]
                if row["status"] == "error":
                    body = json.loads(row["result"])
                    f.error = (body["error"], body["category"])
                f.done.set()
        if f is None or f.tenant != tenant:  # another tenant's id is simply not found
            raise NotFound(f"no request {future_id!r}")
        return f

    def purge_futures(self, keep_seconds: float = 600.0) -> None:
        """Forget results older than `keep_seconds` (at least 5 minutes after completion)."""
        cutoff = time.time() - keep_seconds
        for fid in [k for k, f in self.futures.items() if f.completed_at and f.completed_at < cutoff]:
            del self.futures[fid]
        self.store.purge_futures(keep_seconds)

    # -- submitting -------------------------------------------------------------------

    def submit(self, op: Op) -> Future:
        """Queue `op`; a repeated (model, seq_id) returns the original future."""
        if self.state == "failed":
            raise UserError(f"the model failed to load: {self.load_error}")
        if op.kind == "sample":
            self.samples.append(op)
        else:
            key = (op.model_id, op.seq_id)
            if key in self.seq_index:  # a retry of a request already taken
                self.futures.pop(op.future.id, None)
                self.store.fail_future(op.future.id, "superseded by the original request", "user")
                return self.futures[self.seq_index[key]]
            if op.seq_id < self.next_seq.get(op.model_id, 1):
                self.futures.pop(op.future.id, None)
                message = f"seq_id {op.seq_id} of {op.model_id} has already run"
                self.store.fail_future(op.future.id, message, "user")
                raise UserError(message)
            self.seq_index[key] = op.future.id
            self.queue.setdefault(op.model_id, {})[op.seq_id] = op
        self.wake.set()
        return op.future

    def open_model(self, model_id: str, first_seq: int = 1) -> None:
        self.next_seq[model_id] = first_seq

    # -- the engine loop --------------------------------------------------------------

    async def _run(self) -> None:
        await self._load()
        while True:
            await self.wake.wait()
            self.wake.clear()
            while True:
                batch = self._ready()
                if not batch:
                    break
                await self._execute(batch)

    def _ready(self) -> list[Op]:
        """The next step.

        Training: every model's run of consecutive forward/backward ops from its next
        seq_id, all models together (gradients add up, so chunks of one call and calls of
        many tenants share one pass); else one barrier (optim/save/load/create). Pending
        samples alternate with training steps so that neither starves the other.
        """
        if self.samples and (self._last_was_training or not self._has_ready()):
            self._last_was_training = False
            batch, self.samples = self.samples, []
            return batch
        fwd, barrier = [], None
        for model_id, ops in self.queue.items():
            seq = self.next_seq.get(model_id, 1)
            op = ops.get(seq)
            if op is None:
                continue
            if op.kind != "fwdbwd":
                barrier = barrier or op
                continue
            while op is not None and op.kind == "fwdbwd":
                fwd.append(op)
                seq += 1
                op = ops.get(seq)
        batch = fwd or ([barrier] if barrier else [])
        self._last_was_training = bool(batch)
        return batch

    def _has_ready(self) -> bool:
        return any(ops.get(self.next_seq.get(m, 1)) for m, ops in self.queue.items())

    async def _execute(self, batch: list[Op]) -> None:
        from .runner import run_ops  # engine-side code; imports torch

        for op in batch:
            if op.seq_id is not None:
                del self.queue[op.model_id][op.seq_id]
                self.next_seq[op.model_id] = op.seq_id + 1
                # A retry of a recent request still finds its future; older ones are let go.
                self.seq_index.pop((op.model_id, op.seq_id - 1000), None)
        try:
            outcomes = await self._in_engine(run_ops, self.engine, batch)
        except Exception as e:  # a bug or an engine fault: fail this step, keep serving
            log.exception("step failed")
            outcomes = [(None, f"server error: {type(e).__name__}: {e}", "server")] * len(batch)
        for op, (result, message, category) in zip(batch, outcomes, strict=True):
            if message is None:
                self.resolve(op.future, result)
            else:
                self.fail(op.future, message, category)
            if op.args.get("after") is not None:
                op.args["after"](op, result, message)
