"""Planned steps in, outcomes out: the service's only way to the worker group.

It turns a step's ops into frames, runs them on every rank, and merges the ranks' answers
into one outcome per op: (result, error message or None, category). It remembers which
training adapters are live, so that after a worker dies it can restart the group and
restore each of them from its last persisted state. Torch-free.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from .config import Config
from .engine.types import (
    ATTN_MODULES,
    MLP_MODULES,
    UNEMBED_MODULES,
    AdapterInfo,
    ForwardBackwardResult,
    LoraConfig,
)
from .workers.frames import OpF, OutcomeF, ReplyF, StepF, as_result, to_frame
from .workers.supervisor import WorkerGroup, WorkerLost

log = logging.getLogger("twinkled")

Outcome = tuple[object, str | None, str | None]
RESTART_MESSAGE = ("the worker group failed ({why}) and was restarted; this request did not "
                   "run and its model is back at its last persisted step: submit it again")


def config_of(info: AdapterInfo) -> LoraConfig:
    t = set(info.target_modules)
    return LoraConfig(rank=info.rank, alpha=info.alpha, train_attn=ATTN_MODULES[0] in t,
                      train_mlp=MLP_MODULES[0] in t, train_unembed=UNEMBED_MODULES[0] in t)


class WorkerClient:
    def __init__(self, config: Config):
        self.live_dir = Path(config.data_dir) / "live"
        devices = config.worker_devices()
        threads = config.worker_threads or max(1, (os.cpu_count() or 1) // len(devices))
        options = {"model": str(config.model), "dtype": config.dtype,
                   "max_rank": config.max_rank, "token_budget": config.token_budget,
                   "live_dir": str(self.live_dir), "persist_every": config.persist_every,
                   "threads": threads}
        self.group = WorkerGroup(devices, options,
                                 step_timeout=config.step_timeout_s)
        self.live: dict[str, LoraConfig] = {}  # training adapters to bring back on restart
        self._lock = asyncio.Lock()  # one step (or one recovery) at a time
        self._stopping = False
        self.recovering = False  # the group is being restarted (healthz says "restarting")
        self.on_restart = lambda: None  # the metrics count restarts

    @property
    def model_info(self) -> dict:
        return self.group.model_info

    async def start(self) -> None:
        await self.group.start()

    async def stop(self) -> None:
        self._stopping = True
        async with self._lock:
            await self.group.stop()

    async def watch(self) -> None:
        """Restart the group when a worker dies between steps, before a request notices."""
        while not self._stopping:
            await asyncio.wait(self.group.exits, return_when=asyncio.FIRST_COMPLETED)
            async with self._lock:
                if self.group.dead() and not self._stopping:
                    log.error("worker group lost between steps: %s; restarting it",
                              self.group.dead())
                    await self.recover()

    async def run_ops(self, kind: str, ops: list) -> list[Outcome]:
        """Run one planned step. A worker fault fails the whole step (category "server"),
        then the group is restarted and every live adapter restored before this returns."""
        async with self._lock:
            return await self._run_ops(kind, ops)

    async def _run_ops(self, kind: str, ops: list) -> list[Outcome]:
        outcomes: list[Outcome | None] = [None] * len(ops)
        frames, where = [], []
        for i, op in enumerate(ops):
            try:
                frames.append(to_frame(op.kind, op.args))
                where.append(i)
            except TypeError as e:
                outcomes[i] = (None, str(e), "user")
        if frames:
            try:
                replies = await self.group.run(StepF(0, kind, frames))
            except WorkerLost as e:
                log.error("worker group lost: %s; restarting it", e)
                message = RESTART_MESSAGE.format(why=e)
                await self.recover()
                return [(None, message, "server")] * len(ops)
            for i, frame, merged in zip(where, frames, _merge(frames, replies), strict=True):
                outcomes[i] = merged
                self._track(frame, merged)
        return outcomes

    def _track(self, frame: OpF, outcome: Outcome) -> None:
        result, error, _ = outcome
        if error is None and frame.kind in ("create", "load", "restore"):
            self.live[frame.adapter_id] = config_of(result)
        elif frame.kind in ("unload", "idle_unload"):
            self.live.pop(frame.adapter_id, None)

    async def recover(self) -> None:
        """Restart the group until it comes up, then restore the live adapters."""
        delay = 1.0
        self.recovering = True
        try:
            while True:
                try:
                    await self.group.restart()
                    self.on_restart()
                    failed = await self.restore(dict(self.live))
                    for model, why in failed.items():
                        log.error("adapter %s could not be restored: %s", model, why)
                    return
                except WorkerLost as e:
                    log.error("worker group restart failed: %s; retrying in %.0f s", e, delay)
                    await asyncio.sleep(delay)
                    delay = min(30.0, 2 * delay)
        finally:
            self.recovering = False

    async def restore(self, adapters: dict[str, LoraConfig]) -> dict[str, str]:
        """Bring adapters back from their persisted state (fresh if they have none).
        Returns {model id: why} for those that could not be."""
        if not adapters:
            return {}
        frames = [OpF("restore", adapter_id=m, config=c, dir=str(self.live_dir))
                  for m, c in adapters.items()]
        replies = await self.group.run(StepF(0, "barrier", frames))
        failed = {}
        for frame, outcome in zip(frames, _merge(frames, replies), strict=True):
            self._track(frame, outcome)
            if outcome[1] is not None:
                failed[frame.adapter_id] = outcome[1]
                self.live.pop(frame.adapter_id, None)
        return failed

    async def unload_idle(self, model: str) -> None:
        """Persist an idle adapter and free its memory; `restore` brings it back."""
        async with self._lock:
            await self.group.run(StepF(0, "barrier", [OpF("idle_unload", adapter_id=model)]))
            self.live.pop(model, None)

    async def restore_one(self, model: str, config: LoraConfig) -> str | None:
        """Bring one adapter back between steps; the reason if it could not be."""
        async with self._lock:
            return (await self.restore({model: config})).get(model)

    async def persist_all(self) -> None:
        """Every live adapter's weights and optimizer state on disk (for a hot restart)."""
        frames = [OpF("persist", adapter_id=m) for m in self.live]
        if frames:
            async with self._lock:
                await self.group.run(StepF(0, "barrier", frames))

    def status(self) -> dict:
        return {"workers": self.group.status(), "restarts": self.group.restarts,
                "live_adapters": len(self.live)}


def _merge(frames: list[OpF], replies: list[ReplyF]) -> list[Outcome]:
    """One outcome per op from the ranks' answers (see workers/runner.py for who runs what)."""
    per_op: list[list[OutcomeF]] = [[] for _ in frames]
    for reply in replies:  # rank order
        for o in reply.outcomes:
            per_op[o.index].append(o)
    merged = []
    for frame, got in zip(frames, per_op, strict=True):
        if not got:
            merged.append((None, "no worker answered for this request", "server"))
            continue
        failed = next((o for o in got if o.error is not None), None)
        if failed is not None:
            merged.append((None, failed.error, failed.category or "server"))
        elif frame.kind == "fwdbwd":
            merged.append((_join_rows(got), None, None))
        else:  # a sample ran on one rank; a barrier ran on all, rank 0's answer stands
            merged.append((as_result(frame.kind, got[0]), None, None))
    return merged


def _join_rows(parts: list[OutcomeF]) -> ForwardBackwardResult:
    rows = sorted((j, out) for p in parts for j, out in zip(p.fwdbwd.rows, p.fwdbwd.outputs,
                                                             strict=True))
    metrics: dict[str, float] = {}
    for p in parts:
        for k, v in p.fwdbwd.metrics.items():
            metrics[k] = metrics.get(k, 0.0) + v if k.endswith(":sum") else metrics.get(k, v)
    return ForwardBackwardResult(outputs=[out for _, out in rows], metrics=metrics)
