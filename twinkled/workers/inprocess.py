"""A worker group of one rank in this process: the engine runs in a thread.

It speaks the same frames as the ZeroMQ group (supervisor.py), encoded and decoded the same
way, and runs them with the same StepRunner, so the executor (twinkled/core/executor.py) cannot
tell the two apart. The service's tests drive the whole daemon core with it, without
subprocesses; the event loop stays free while a step runs (one engine thread, so steps and
the write-behind persistence between them never overlap).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from twinkled.protocol.blobs import Blobs
from twinkled.protocol.frames import ReplyF, StepF, encoder, reply_decoder, step_decoder

from .gaps import GapWindow

# transformers builds a model under process-wide state (the default device and dtype, meta
# tensors): two groups of this process (lanes) must not load at the same time.
_LOADING = threading.Lock()


class InProcessGroup:
    def __init__(self, model: str | Path, *, device: str = "cpu", dtype: str = "float32",
                 max_rank: int = 64, token_budget: int = 16384, packing: bool = True,
                 shared_prefix: int = 32, fused_kernels: str = "all",
                 sample_kv_mb: int = 0, sample_rows: int = 256, live_dir: Path | None = None,
                 persist_every: int = 1,
                 sample_prefix_cache: float = 0.0, logprob_gap_every: int = 0,
                 max_seq_len: int = 0, rope_scaling: dict | None = None,
                 checkpoint_store: dict | None = None, bank_max_bytes: int | None = None,
                 host_max_bytes: int | None = None):
        self.devices = [device]
        self.model_info: dict = {}
        self.restarts = 0
        self.gaps = GapWindow()  # sampler vs trainer logprobs, as the replies report them
        self._engine_args = {"dtype": dtype, "device": device, "max_rank": max_rank,
                             "token_budget": token_budget, "packed": packing,
                             "shared_prefix": shared_prefix, "fused": fused_kernels,
                             "kv_bytes": sample_kv_mb << 20 or None, "sample_rows": sample_rows,
                             "prefix_cache": sample_prefix_cache,
                             "max_seq_len": max_seq_len or None,
                             "rope_scaling": rope_scaling or None,
                             "bank_max_bytes": bank_max_bytes}
        self._model = str(model)
        self._live_dir, self._persist_every = live_dir, persist_every
        self._gap_every = logprob_gap_every
        self._store = checkpoint_store  # where checkpoints live (protocol/blobs.py)
        self._host_max_bytes = host_max_bytes  # parked adapters' host memory (parked.py)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._runner = None
        self._stopped: asyncio.Future | None = None
        self._pump: asyncio.Task | None = None
        self._step = 0
        self._busy_s = 0.0  # seconds spent running steps
        # "join" steps sent during a training step (`send_join`), run between its micro-batches
        self._joins: queue.SimpleQueue = queue.SimpleQueue()
        self._running = False
        self._nudged = threading.Event()  # work arrived during a long sampling slice

    @property
    def exits(self) -> list[asyncio.Future]:
        """Done when the group is stopped (an in-process rank cannot die alone)."""
        return [self._stopped] if self._stopped is not None else []

    def dead(self) -> str:
        return ""

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._stopped = loop.create_future()
        self._runner, self.model_info = await loop.run_in_executor(self._thread, self._load)

    def _load(self):
        from twinkled.engine import Engine

        from .persist import Persister
        from .runner import StepRunner

        with _LOADING:
            engine = Engine(self._model, **self._engine_args)
        persister = (Persister(self._live_dir, self._persist_every)
                     if self._live_dir is not None else None)
        cfg = engine.model.config
        info = {"arch": cfg.model_type, "max_seq_len": engine.model.max_seq_len,
                "kv_tokens": engine.kv_tokens,
                "vocab_size": cfg.vocab_size,
                "dtype": str(engine.model.dtype).replace("torch.", "")}
        return StepRunner(engine, 0, 1, persister, gap_every=self._gap_every,
                          blobs=Blobs.from_spec(self._store),
                          host_max_bytes=self._host_max_bytes), info

    async def run(self, step: StepF) -> list[ReplyF]:
        """Run `step` on the engine thread; the frames cross the same codec as over ZeroMQ."""
        frame = self._frame(step)
        loop = asyncio.get_running_loop()
        self._running = step.kind == "train"
        self._nudged.clear()
        try:
            reply = await loop.run_in_executor(self._thread, self._run, frame, self._drain)
        finally:
            self._running = False
        if not self._joins.empty():  # sent too late to join: run now, as a rank would
            await loop.run_in_executor(self._thread, self._drain)
        self._busy_s += reply.busy_s
        if self._pump is None or self._pump.done():
            self._pump = loop.create_task(self._between_steps())
        replies = [reply_decoder.decode(encoder.encode(reply))]
        self.gaps.add(replies)
        return replies

    def _frame(self, step: StepF) -> StepF:
        self._step += 1
        step.id = self._step
        return step_decoder.decode(encoder.encode(step))

    def can_join(self) -> bool:
        """Whether a "join" step may be sent now (WorkerGroup.can_join)."""
        return self._running

    def send_join(self, step: StepF) -> asyncio.Future:
        """Queue `step` for the engine thread, which runs it between two micro-batches of
        the training step in flight (WorkerGroup.send_join); the future's result is [its reply]."""
        assert self.can_join(), "join: no training step in flight"
        loop = asyncio.get_running_loop()
        reply = loop.create_future()
        self._joins.put((self._frame(step), reply, loop))
        return reply

    def nudge(self) -> None:
        """Work arrived: a long sampling slice in flight ends (WorkerGroup.nudge)."""
        self._nudged.set()

    def _drain(self) -> None:
        """On the engine thread, between micro-batches: run the joins sent meanwhile."""
        while not self._joins.empty():
            frame, reply, loop = self._joins.get()
            try:
                out = reply_decoder.decode(encoder.encode(self._run(frame, joined=True)))
                loop.call_soon_threadsafe(reply.set_result, [out])
            except Exception as e:  # noqa: BLE001 - handed to the joiner's caller
                loop.call_soon_threadsafe(reply.set_exception, e)

    def _run(self, step: StepF, between=None, joined: bool = False) -> ReplyF:
        started = time.perf_counter()
        outcomes = self._runner.run(step, between, joined, self._nudged.is_set)
        return ReplyF(step.id, 0, outcomes, 0, 0, self._runner.persisted(),
                      time.perf_counter() - started, sampling=self._runner.sampling_news(step),
                      gaps=self._runner.gaps())

    async def _between_steps(self) -> None:
        """What a worker does while idle: hand changed adapters to the writer."""
        loop = asyncio.get_running_loop()
        while await loop.run_in_executor(self._thread, self._runner.between_steps):
            await asyncio.sleep(0.05)

    async def restart(self) -> None:
        self.restarts += 1

    async def stop(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
        if self._stopped is not None and not self._stopped.done():
            self._stopped.set_result(None)
        self._thread.shutdown(wait=False)

    def status(self) -> list[dict]:
        return [{"rank": 0, "device": self.devices[0], "pid": None, "memory_bytes": 0, "peak_memory_bytes": 0,
                 "busy_s": round(self._busy_s, 3), "alive": self._runner is not None, "up_s": 0.0}]
