"""The daemon's side of the worker group: start it, drive it, notice when it dies.

Torch-free (the HTTP process never imports torch). One ROUTER socket talks to every rank's
DEALER; a step is encoded once and sent to all ranks; `run` returns when every rank has
answered, and raises WorkerLost as soon as any rank exits or the step overruns its time.
The caller then fails that step's requests and calls `restart`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
import socket
import sys
import time
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from .frames import HelloF, ReplyF, StepF, encoder, reply_decoder

log = logging.getLogger("twinkled")


class WorkerLost(RuntimeError):
    """A worker exited, failed to start, or stopped answering."""


@dataclass
class WorkerInfo:
    rank: int
    device: str
    pid: int | None = None
    memory: int = 0
    started: float = field(default_factory=time.time)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerGroup:
    """`devices`: one worker per entry ("cpu", "cuda:0", ...). `options` go to each worker
    (model, dtype, max_rank, token_budget, live_dir, persist_every, threads)."""

    def __init__(self, devices: list[str], options: dict, start_timeout: float = 900.0,
                 step_timeout: float = 900.0):
        self.devices = devices
        self.options = options
        self.start_timeout = start_timeout
        self.step_timeout = step_timeout
        self.workers = [WorkerInfo(r, d) for r, d in enumerate(devices)]
        self.model_info: dict = {}
        self.restarts = 0
        self._procs: list[asyncio.subprocess.Process] = []
        self._exits: list[asyncio.Task] = []
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._endpoint = ""
        self._step = 0
        # Ranks are named "<group>:<rank>". A process of another group (an orphan of a
        # daemon that died, reconnecting to a port this one reuses) is ignored, never
        # taken for one of ours.
        self._group = secrets.token_hex(8)

    @property
    def world(self) -> int:
        return len(self.devices)

    @property
    def exits(self) -> list[asyncio.Task]:
        """One task per rank of the current group, done when that process has exited."""
        return list(self._exits)

    def dead(self) -> str:
        """Which rank of the current group has exited ("" when all are alive)."""
        for w, p in zip(self.workers, self._procs, strict=False):
            if p.returncode is not None:
                return f"worker rank {w.rank} (pid {w.pid}) exited with code {p.returncode}"
        return ""

    async def start(self) -> None:
        """Spawn the ranks and wait until every one has loaded the model."""
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.ROUTER)
            self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted rank takes its name
            self._sock.setsockopt(zmq.LINGER, 0)
            port = self._sock.bind_to_random_port("tcp://127.0.0.1")
            self._endpoint = f"tcp://127.0.0.1:{port}"
        dist_url = f"tcp://127.0.0.1:{_free_port()}"
        self._procs, self._exits = [], []
        for w in self.workers:
            args = {**self.options, "rank": w.rank, "world": self.world, "device": w.device,
                    "endpoint": self._endpoint, "dist_url": dist_url, "group": self._group}
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "twinkled.workers.worker", json.dumps(args),
                env={**os.environ, "PYTHONUNBUFFERED": "1"})
            w.pid, w.started = proc.pid, time.time()
            self._procs.append(proc)
            self._exits.append(asyncio.create_task(proc.wait()))
        hellos = await self._gather(self.start_timeout, lambda m: isinstance(m, HelloF), "start")
        errors = [h.error for h in hellos if h.error]
        if errors:
            await self.kill()
            raise WorkerLost(f"worker start-up failed: {errors[0]}")
        self.model_info = hellos[0].model
        log.info("worker group up: %d rank(s) on %s (pids %s)", self.world,
                 ",".join(self.devices), [w.pid for w in self.workers])

    async def run(self, step: StepF) -> list[ReplyF]:
        """Send `step` to every rank; their replies, in rank order."""
        if self.dead():
            raise WorkerLost(self.dead())
        self._step += 1
        step.id = self._step
        data = encoder.encode(step)
        for w in self.workers:
            await self._sock.send_multipart([f"{self._group}:{w.rank}".encode(), data])
        replies = await self._gather(
            self.step_timeout, lambda m: isinstance(m, ReplyF) and m.step == step.id, "step")
        for w, r in zip(self.workers, replies, strict=True):
            w.memory = r.memory
        return replies

    async def _gather(self, timeout: float, wanted, what: str) -> list:
        """One wanted message per rank; WorkerLost if a rank exits or time runs out."""
        got: dict[int, object] = {}
        deadline = asyncio.get_running_loop().time() + timeout
        while len(got) < self.world:
            recv = asyncio.ensure_future(self._sock.recv_multipart())
            left = deadline - asyncio.get_running_loop().time()
            done, _ = await asyncio.wait([recv, *self._exits], timeout=max(0.0, left),
                                         return_when=asyncio.FIRST_COMPLETED)
            if recv not in done:
                recv.cancel()
                if any(t.done() for t in self._exits):
                    raise WorkerLost(f"{self.dead()} during {what}")
                raise WorkerLost(f"the worker group did not answer within {timeout:.0f} s "
                                 f"during {what}")
            ident, frame = recv.result()
            group, _, rank = ident.decode(errors="replace").partition(":")
            try:
                msg = reply_decoder.decode(frame)
            except msgspec.DecodeError as e:
                msg = None
                log.warning("ignored an unreadable frame from %r: %s", ident, e)
            if group != self._group or not rank.isdigit() or int(rank) >= self.world:
                log.warning("ignored a frame from %r, not a rank of this worker group", ident)
            elif msg is not None and (wanted(msg) or (isinstance(msg, HelloF) and msg.error)):
                got[int(rank)] = msg
        return [got[r] for r in range(self.world)]

    async def restart(self) -> None:
        self.restarts += 1
        await self.kill()
        await self.start()

    async def kill(self) -> None:
        """SIGKILL every rank (a rank may be stuck in a collective) and reap them."""
        for proc in self._procs:
            if proc.returncode is None:
                try:
                    proc.send_signal(signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self._exits:
            await asyncio.wait(self._exits, timeout=30)

    async def stop(self, grace: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds."""
        for proc in self._procs:
            if proc.returncode is None:
                proc.terminate()
        if self._exits:
            _, pending = await asyncio.wait(self._exits, timeout=grace)
            if pending:
                await self.kill()
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        self._ctx.destroy(linger=0)  # nothing may keep the process from exiting

    def status(self) -> list[dict]:
        return [{"rank": w.rank, "device": w.device, "pid": w.pid, "memory_bytes": w.memory,
                 "alive": p.returncode is None, "up_s": round(time.time() - w.started, 1)}
                for w, p in zip(self.workers, self._procs, strict=False)]
