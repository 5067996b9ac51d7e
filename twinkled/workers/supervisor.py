"""The daemon's side of the worker group: start it, drive it, notice when it dies.

Torch-free (the HTTP process never imports torch). One ROUTER socket talks to every rank's
DEALER; a step is encoded once and sent to all ranks; `run` returns when every rank has
answered, and raises WorkerLost as soon as any rank exits or the step overruns its time.
The caller then fails that step's requests and calls `restart`.

With a host registry the group may also hold ranks on other hosts (`twinkled worker
--join`, hosts.py): local ranks come first (rank 0, which persists, is always here), then
each joined host's devices. A remote rank's loss is a future that its host registry
resolves (an agent's report, or its silence); it counts like a local process's exit. The
registry is the daemon's, shared with the lanes other hosts bring (remote_lane.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
import socket
import time
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from twinkled.protocol import trace
from twinkled.protocol.frames import HelloF, ReplyF, StepF, encoder, reply_decoder
from twinkled.protocol.logs import relay

from .addresses import bind_host, free_port, reachable
from .gaps import GapWindow
from .hosts import HostRegistry, JoinSettings, RemoteHost
from .launch import Forked, Launcher, arch_preload, worker_env

log = logging.getLogger("twinkled")
PORT_TAKEN = "EADDRINUSE"  # (torch's DistNetworkError names the errno)
START_TRIES = 3  # more starts when the rendezvous port was taken meanwhile


class WorkerLost(RuntimeError):
    """A worker exited, failed to start, or stopped answering."""


@dataclass
class WorkerInfo:
    rank: int
    device: str
    pid: int | None = None
    memory: int = 0
    peak_memory: int = 0
    busy_s: float = 0.0  # seconds spent running steps since the group (re)started
    started: float = field(default_factory=time.time)
    host: str = ""  # "" on this host; else the joined host's name
    lost: asyncio.Future | None = None  # a remote rank: resolves when its host loses it


class WorkerGroup:
    """`devices`: one worker per entry ("cpu", "cuda:0", ...). `options` go to each worker
    (model, dtype, max_rank, token_budget, live_dir, persist_every, threads)."""

    def __init__(self, devices: list[str], options: dict, start_timeout: float = 900.0,
                 step_timeout: float = 900.0, join: JoinSettings | None = None,
                 hosts: HostRegistry | None = None):
        """`hosts`: the daemon's registry of joined hosts, when others may join (`join`:
        its settings); the group takes in those that bring ranks, not lanes."""
        self.devices = devices  # this host's
        self.options = options
        self.start_timeout = start_timeout
        self.step_timeout = step_timeout
        self.workers = [WorkerInfo(r, d) for r, d in enumerate(devices)]  # the current group
        self.model_info: dict = {}
        self.restarts = 0
        self.gaps = GapWindow()  # sampler vs trainer logprobs, as the replies report them
        self._launcher = Launcher(arch_preload(options.get("model")))
        self._procs: list[asyncio.subprocess.Process | Forked] = []
        self._relays: list[asyncio.Future] = []  # copying the ranks' output (JSON logs)
        self._exits: list[asyncio.Future] = []  # local exits and remote losses
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._endpoint = ""
        self._bind_host = bind_host(join)
        self._step = 0
        # "join" steps sent during the training step in flight (`send_join`): step id -> the
        # future of its reply, which that step's gather hands over (a one-rank group).
        self._joins: dict[int, asyncio.Future] = {}
        self._running = False  # a training step is in flight whose ranks may take joins
        self._long_slice = False  # a sampling slice that may run long is in flight, un-nudged
        self.join = join
        self.hosts = hosts
        if hosts is not None:
            hosts.on_join.append(self._on_join)
        self._grow: asyncio.Future | None = None  # a host joined: restart to take it in
        # Ranks are named "<group>:<rank>", with a new group id at every start. A process
        # of another group (an orphan of a daemon that died, reconnecting to a port this
        # one reuses, or a remote rank of the last start) is ignored, never taken for one
        # of ours.
        self._group = secrets.token_hex(8)

    @property
    def world(self) -> int:
        return len(self.workers)

    @property
    def exits(self) -> list[asyncio.Future]:
        """Done when a rank of the current group is gone (a local process exited, a host
        lost its rank), or when a new host joined and the group should restart to take it
        in: then `dead()` says so."""
        return self._exits + ([self._grow] if self._grow is not None else [])

    def dead(self) -> str:
        """Why the current group must restart ("" when all is well)."""
        lost = self._lost()
        if not lost and self._grow is not None and self._grow.done():
            return self._grow.result()
        return lost

    def _lost(self) -> str:
        """Which rank of the current group is gone ("" when all are alive)."""
        for w, p in zip(self.workers, self._procs, strict=False):
            if p.returncode is not None:
                return f"worker rank {w.rank} (pid {w.pid}) exited with code {p.returncode}"
        for w in self.workers:
            if w.lost is not None and w.lost.done() and not w.lost.cancelled():
                return w.lost.result()
        return ""

    async def start(self) -> None:
        """Spawn the ranks and wait until every one has loaded the model. A remote host
        whose ranks fail to come up is left out and the group started again without it:
        a host can cost a start, never the daemon's."""
        taken = 0  # starts whose rendezvous port was taken meanwhile
        while True:
            failed: set[str] = set()
            try:
                await self._start(failed)
                return
            except WorkerLost as e:
                await self.kill()
                # The rendezvous port is free when picked and bound by rank 0 a moment
                # later: another process may take it in between (seen in the test suite's
                # parallel daemons). Another port, then, a few times.
                if not failed and PORT_TAKEN in str(e) and taken < START_TRIES:
                    taken += 1
                    log.warning("the workers' rendezvous port was taken before rank 0 bound "
                                "it; starting them again on another")
                    continue
                if not failed:
                    raise
                for host in self.hosts.ready():
                    if host.name in failed:
                        self.hosts.ban(host, "its ranks did not start")

    async def _start(self, failed: set[str]) -> None:
        await self._open()
        self._group = secrets.token_hex(8)
        self.workers = [WorkerInfo(r, d) for r, d in enumerate(self.devices)]
        plan: list[tuple[RemoteHost, list[int], list[str]]] = []  # (two agents may share a
        for host, devices in await self._remote_plan():  # host name)
            ranks = list(range(len(self.workers), len(self.workers) + len(devices)))
            plan.append((host, ranks, devices))
            self.workers += [WorkerInfo(r, d, host=host.name)
                             for r, d in zip(ranks, devices, strict=True)]
        dist_port = free_port(self._bind_host)
        local = reachable(self._bind_host)
        # Ranks on several hosts cannot read each other's files: rank 0 then hands out what
        # a load or a restore reads (runner.py).
        options = {**self.options, "world": self.world, "group": self._group,
                   "spans_hosts": bool(plan) and bool(self.devices)}
        self._procs, self._exits = [], []
        self._relays = [t for t in self._relays if not t.done()]
        for w in self.workers[:len(self.devices)]:
            args = {**options, "rank": w.rank, "device": w.device, "endpoint": self._endpoint,
                    "dist_url": f"tcp://{local}:{dist_port}", "parent": os.getpid()}
            # A session of its own: a Ctrl+C in the terminal, `timeout` or a container
            # runtime signals the daemon's process group, and a rank that got the signal
            # too would die mid-drain, before shutdown persists its adapters. The daemon
            # stops its ranks itself (stop / kill), and a rank dies with the daemon anyway
            # (PR_SET_PDEATHSIG and a parent check, worker.py).
            # In JSON mode a rank's output comes through the daemon (logs.relay), which
            # makes JSON of any line that is not. Progress bars are off: a log is no tty.
            piped = self.options.get("log_format") == "json"
            # (Forked from a zygote, launch.py, with torch and transformers imported.)
            proc = await self._launcher.spawn(
                ["-m", "twinkled.workers.worker", json.dumps(args)], worker_env(), piped)
            if piped:
                self._relays.append(asyncio.ensure_future(
                    relay(proc.stdout, "twinkled.worker", rank=w.rank)))
            w.pid, w.started = proc.pid, time.time()
            self._procs.append(proc)
            self._exits.append(asyncio.ensure_future(proc.wait()))
        for host, ranks, devices in plan:
            lost = await self.hosts.assign(host, self._group, ranks, devices, self.world,
                                           int(self._endpoint.rpartition(":")[2]), dist_port,
                                           options)
            for r in ranks:
                self.workers[r].lost = lost
            self._exits.append(lost)
        self._grow = asyncio.get_running_loop().create_future()
        got: dict[int, HelloF] = {}
        try:
            await self._gather(self.start_timeout, lambda m: isinstance(m, HelloF), "start",
                               got)
        except WorkerLost:
            failed |= self._blame(got)
            raise
        errors = [h.error for h in got.values() if h.error]
        if errors:
            failed |= self._blame(got)
            raise WorkerLost(f"worker start-up failed: {errors[0]}")
        for w in self.workers:
            w.pid = got[w.rank].pid
        self.model_info = got[0].model
        log.info("worker group up: %d rank(s): %s", self.world,
                 ", ".join(f"{w.device}@{w.host or 'local'}" for w in self.workers))

    async def _remote_plan(self) -> list[tuple[RemoteHost, list[str]]]:
        """The joined hosts that run ranks of this group, each with its devices for them
        (their ranks come after the local ones)."""
        if self.hosts is None:
            return []
        await self.hosts.wait_for(self.join.remote_ranks, self.join.timeout_s)
        return self.hosts.rank_plan(int(self.options.get("tp", 1)))

    def _blame(self, got: dict[int, HelloF]) -> set[str]:
        """The remote hosts to leave out after a failed start: those with a rank that did
        not come up, when every local rank did (else the fault is likely here)."""
        def bad(w: WorkerInfo) -> bool:
            return w.rank not in got or got[w.rank].error is not None

        if any(bad(w) for w in self.workers if not w.host):
            return set()
        return {w.host for w in self.workers if w.host and bad(w)}

    def _on_join(self, host: RemoteHost) -> None:
        if host.lanes:  # it brings lanes of its own, not ranks for this group
            return
        if self._grow is not None and not self._grow.done() and self.model_info:
            self._grow.set_result(f"host {host.name} joined with {len(host.devices)} "
                                  f"device(s): restarting the group to take it in")

    async def _open(self) -> None:
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.ROUTER)
            self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted rank takes its name
            self._sock.setsockopt(zmq.LINGER, 0)
            port = self._sock.bind_to_random_port(f"tcp://{self._bind_host}")
            self._endpoint = f"tcp://{reachable(self._bind_host)}:{port}"
        if self.hosts is not None:
            await self.hosts.open()

    async def run(self, step: StepF) -> list[ReplyF]:
        """Send `step` to every rank; their replies, in rank order."""
        if self._lost():
            raise WorkerLost(self._lost())
        data = self._send_prepare(step)
        sent = time.time()
        for w in self.workers:
            await self._sock.send_multipart([f"{self._group}:{w.rank}".encode(), data])
        arrived: dict[int, float] = {}
        self._running = step.kind == "train" and self.world == 1
        self._long_slice = step.slice_max_s > step.slice_s
        try:
            replies = await self._gather(
                self.step_timeout, lambda m: isinstance(m, ReplyF) and m.step == step.id,
                "step", arrived=arrived)
            self._running = False
            if self._joins:  # sent too late to join: the rank runs them next, at once
                await self._gather(self.step_timeout, lambda m: False, "a joined step",
                                   until=lambda: not self._joins)
        except WorkerLost as e:
            for f in self._joins.values():
                if not f.done():
                    f.set_exception(WorkerLost(str(e)))
            self._joins.clear()
            raise
        finally:
            self._running = False
            self._long_slice = False
        for w, r in zip(self.workers, replies, strict=True):
            w.memory = r.memory
            w.peak_memory = r.peak_memory
            w.busy_s += r.busy_s
        self.gaps.add(replies)
        if trace.enabled():
            trace.record("group", step=step.id, kind=step.kind, sent=sent, bytes=len(data),
                         ranks=[{"began": r.began, "busy": r.busy_s, "arrived": arrived[i],
                                 "phases": r.phases}
                                for i, r in enumerate(replies)])
        return replies

    def _send_prepare(self, step: StepF) -> bytes:
        self._step += 1
        step.id = self._step
        return encoder.encode(step)

    def can_join(self) -> bool:
        """Whether a "join" step may be sent now: a training step runs on one rank."""
        return self._running and not self._lost()

    def nudge(self) -> None:
        """Work arrived: the ranks of a sampling slice in flight that may run long
        (`slice_max_s`) end it once its `slice_s` passed. Sent once a step, at once (as
        `send_join`); a rank that already answered drops it."""
        if not self._long_slice or self._lost():
            return
        self._long_slice = False
        data = encoder.encode(StepF(0, "nudge", []))
        for w in self.workers:
            self._sock.send_multipart([f"{self._group}:{w.rank}".encode(), data])

    def send_join(self, step: StepF) -> asyncio.Future:
        """Send `step` into the training step in flight, now: its rank runs it between two
        micro-batches (or right after the step, if it came too late) and answers it at
        once; the future's result is [its reply] (WorkerLost if the group fails first).
        Only while `can_join`."""
        assert self.can_join(), "join: no training step in flight on a one-rank group"
        data = self._send_prepare(step)
        reply = asyncio.get_running_loop().create_future()
        self._joins[step.id] = reply
        # A router socket sends without waiting (pyzmq sends at once when it can, and in
        # order), so the join is on its way before the step in flight can be answered.
        self._sock.send_multipart([f"{self._group}:0".encode(), data])
        return reply

    async def _gather(self, timeout: float, wanted, what: str,
                      got: dict | None = None, arrived: dict | None = None,
                      until=None) -> list:
        """One wanted message per rank (into `got`), or until `until()`; WorkerLost if a
        rank is lost or time runs out."""
        got = {} if got is None else got
        deadline = asyncio.get_running_loop().time() + timeout
        while len(got) < self.world and not (until is not None and until()):
            recv = asyncio.ensure_future(self._sock.recv_multipart())
            left = deadline - asyncio.get_running_loop().time()
            done, _ = await asyncio.wait([recv, *self._exits], timeout=max(0.0, left),
                                         return_when=asyncio.FIRST_COMPLETED)
            if recv not in done:
                recv.cancel()
                if any(t.done() for t in self._exits):
                    if what == "start" and await self._last_words(got):
                        break  # (its reason: `_start` says it, and may try again)
                    raise WorkerLost(f"{self._lost()} during {what}")
                raise WorkerLost(f"the worker group did not answer within {timeout:.0f} s "
                                 f"during {what}")
            rank, msg = self._frame(recv.result())
            if rank is None or msg is None:
                continue
            if isinstance(msg, ReplyF) and msg.step in self._joins:
                self._joins.pop(msg.step).set_result([msg])  # a joined step's (see `send_join`)
            elif wanted(msg) or (isinstance(msg, HelloF) and msg.error):
                got[rank] = msg
                if arrived is not None:
                    arrived[rank] = time.time()
        return [got[r] for r in range(self.world) if r in got]

    async def _last_words(self, got: dict, grace: float = 1.0) -> bool:
        """A rank that exited during start sends why just before (worker.py): its message
        may come after its exit is seen. Whether one came (into `got`) within `grace`."""
        deadline = asyncio.get_running_loop().time() + grace
        while (left := deadline - asyncio.get_running_loop().time()) > 0:
            try:
                rank, msg = self._frame(
                    await asyncio.wait_for(self._sock.recv_multipart(), left), quiet=True)
            except TimeoutError:
                return False
            if rank is not None and isinstance(msg, HelloF) and msg.error:
                got[rank] = msg
                return True
        return False

    def _frame(self, parts: list[bytes], quiet: bool = False) -> tuple[int | None, object]:
        """(rank, message) of what came on the worker socket; rank None for anything not
        from a rank of this group, message None where unreadable (said unless `quiet`)."""
        if len(parts) != 2:  # not a rank's [identity, frame]: any local process can
            # connect to this port (seen: a stray HTTP client's bytes, which ZMQ's
            # unversioned framing read as a message of several parts, ended the start)
            if not quiet:
                log.warning("ignored a message of %d part(s) on the worker socket", len(parts))
            return None, None
        ident, frame = parts
        group, _, rank = ident.decode(errors="replace").partition(":")
        try:
            msg = reply_decoder.decode(frame)
        except msgspec.DecodeError as e:
            msg = None
            if not quiet:
                log.warning("ignored an unreadable frame from %r: %s", ident, e)
        if group != self._group or not rank.isdigit() or int(rank) >= self.world:
            if not quiet:
                log.warning("ignored a frame from %r, not a rank of this worker group", ident)
            return None, msg
        return int(rank), msg

    async def restart(self) -> None:
        self.restarts += 1
        await self.kill()
        await self.start()

    async def kill(self) -> None:
        """SIGKILL every local rank (a rank may be stuck in a collective) and reap them;
        every remote host kills its own."""
        for proc in self._procs:
            if proc.returncode is None:
                try:
                    proc.send_signal(signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.hosts is not None:
            await self.hosts.release(self._group)
        if self._procs:
            await asyncio.wait([asyncio.ensure_future(p.wait()) for p in self._procs],
                               timeout=30)

    async def stop(self, grace: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds."""
        for proc in self._procs:
            if proc.returncode is None:
                proc.terminate()
        if self.hosts is not None:
            await self.hosts.release(self._group)
        if self._procs:
            waits = [asyncio.ensure_future(p.wait()) for p in self._procs]
            _, pending = await asyncio.wait(waits, timeout=grace)
            if pending:
                await self.kill()
        await self._launcher.stop()
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        self._ctx.destroy(linger=0)  # nothing may keep the process from exiting

    def status(self) -> list[dict]:
        here = socket.gethostname()
        out = []
        for w in self.workers:
            if w.host:
                alive = w.lost is not None and not w.lost.done()
            else:
                p = self._procs[w.rank] if w.rank < len(self._procs) else None
                alive = p is not None and p.returncode is None
            out.append({"rank": w.rank, "device": w.device, "host": w.host or here,
                        "remote": bool(w.host), "pid": w.pid, "memory_bytes": w.memory,
                        "peak_memory_bytes": w.peak_memory,
                        "busy_s": round(w.busy_s, 3), "alive": alive, "up_s": round(time.time() - w.started, 1),
                        "group": self._group, "endpoint": self._endpoint})
        return out
