"""The head's side of remote hosts: who has joined, who is alive, what they run.

Torch-free; runs on the daemon's event loop. One ROUTER on `join_listen` talks to every
host agent (`twinkled worker --join`, host.py). A host is taken in only after it proves it
holds the join token (challenge/response, join.py). Liveness cannot come from exit codes
on another machine, so it comes from messages: the agent reports a rank that exited
(LostF), says goodbye, or falls silent for `heartbeat_s`. Each of these resolves the
host's `lost` future, which the worker group waits on next to its local processes.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from .join import (
    AssignF,
    BeatF,
    ByeF,
    ChallengeF,
    JoinHelloF,
    LostF,
    ProofF,
    RefusedF,
    StopF,
    WelcomeF,
    check_proof,
    decoder,
    encoder,
    ensure_token,
)

log = logging.getLogger("twinkled")
_DEVICE_NAMES = ("cpu", "cuda")
# Unanswered challenges kept, in all and per peer address: a flood of hellos is refused
# (try again later), never grows memory and never evicts a real host's challenge.
_PENDING_MAX = 64
_PENDING_PER_PEER = 4
_PENDING_S = 30.0  # a challenge not answered in this long is forgotten
# Every message a host sends here is small (hello, proof, beats): a bigger frame is cut
# off by ZeroMQ as it arrives (the peer is disconnected), before it is buffered, before
# the sender has proved it holds the token.
_FRAME_MAX = 1 << 16
_BAN_S = (30.0, 3600.0)  # first and longest time a host whose ranks failed is kept out


@dataclass
class JoinSettings:
    """The config keys of a group that spans hosts (config.py documents them)."""

    listen: str  # tcp://ADDRESS:PORT
    token_file: Path
    remote_ranks: int = 0  # remote ranks to wait for at each (re)start
    timeout_s: float = 60.0  # how long to wait for them
    heartbeat_s: float = 10.0  # a host silent this long is lost

    @property
    def bind_host(self) -> str:
        return self.listen[len("tcp://"):].rpartition(":")[0]


def _peer(frame: zmq.Frame) -> str:
    """The address a frame came from (ZeroMQ's Peer-Address), "" where it has none."""
    try:
        return frame.get("Peer-Address") or ""
    except zmq.ZMQError:
        return ""


def join_settings(config) -> JoinSettings | None:
    """The Config's join keys; None when no remote host may join (the default)."""
    if not config.join_listen:
        return None
    token = config.join_token_file or str(Path(config.data_dir) / "join.key")
    return JoinSettings(config.join_listen, Path(token), config.remote_ranks,
                        config.join_timeout_s, config.join_heartbeat_s)


@dataclass
class RemoteHost:
    ident: bytes  # the agent's socket identity
    name: str
    devices: list[str]
    pid: int
    seen: float = field(default_factory=time.monotonic)
    joined: float = field(default_factory=time.time)
    group: str = ""  # the group its ranks belong to ("" when it runs none)
    ranks: list[int] = field(default_factory=list)
    pids: dict[int, int] = field(default_factory=dict)
    lost: asyncio.Future | None = None  # resolves with why its ranks are gone


class HostRegistry:
    def __init__(self, settings: JoinSettings, ctx: zmq.asyncio.Context):
        self.settings = settings
        self.token = ensure_token(settings.token_file)
        self.hosts: dict[bytes, RemoteHost] = {}  # joined and authenticated, in join order
        self.on_join: Callable[[RemoteHost], None] = lambda host: None
        self._ctx = ctx
        self._sock: zmq.asyncio.Socket | None = None
        # ident -> (nonce, hello, when, peer address)
        self._pending: dict[bytes, tuple[bytes, JoinHelloF, float, str]] = {}
        self._banned: dict[str, tuple[float, float, str]] = {}  # name -> (until, length, why)
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    @property
    def beat_s(self) -> float:
        return max(0.2, min(1.0, self.settings.heartbeat_s / 4))

    async def open(self) -> None:
        if self._sock is not None:
            return
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, _FRAME_MAX)
        self._sock.bind(self.settings.listen)
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._beat())]
        log.info("remote hosts may join at %s (token in %s)", self.settings.listen,
                 self.settings.token_file)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._sock is not None:
            for host in self.hosts.values():
                await self._send(host.ident, ByeF("the daemon is stopping"))
            self._sock.close(0)
            self._sock = None

    def ready(self) -> list[RemoteHost]:
        """The hosts that may run ranks now, in the order they joined."""
        now = time.time()
        return [h for h in self.hosts.values() if self._banned.get(h.name, (0,))[0] <= now]

    async def wait_for(self, ranks: int, timeout: float) -> None:
        """Until the ready hosts offer `ranks` devices, or `timeout` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while sum(len(h.devices) for h in self.ready()) < ranks:
            left = deadline - loop.time()
            if left <= 0:
                have = sum(len(h.devices) for h in self.ready())
                log.warning("%d of %d remote rank(s) joined within %.0f s; starting without "
                            "the others", have, ranks, timeout)
                return
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(left, 1.0))
            except TimeoutError:
                pass

    async def assign(self, host: RemoteHost, group: str, ranks: list[int], world: int,
                     step_port: int, dist_port: int, options: dict) -> asyncio.Future:
        """Tell `host` to run `ranks`; the future resolves with why, if it loses them."""
        host.group, host.ranks, host.pids = group, ranks, {}
        host.lost = asyncio.get_running_loop().create_future()
        await self._send(host.ident, AssignF(group, ranks, host.devices[:len(ranks)], world,
                                             step_port, dist_port, options))
        return host.lost

    async def release(self) -> None:
        """Every host stops the ranks it runs (the group restarts or stops)."""
        for host in self.hosts.values():
            if host.group:
                await self._send(host.ident, StopF(host.group))
            host.group, host.ranks, host.pids = "", [], {}
            if host.lost is not None and not host.lost.done():
                host.lost.cancel()
            host.lost = None

    def ban(self, host: RemoteHost, why: str) -> None:
        """Keep a host whose ranks failed to start out of the next (re)starts for a while
        (doubling each time), so one broken host cannot keep the group from coming up."""
        length = min(_BAN_S[1], 2 * self._banned[host.name][1]) if host.name in self._banned \
            else _BAN_S[0]
        self._banned[host.name] = (time.time() + length, length, why)
        log.error("host %s is left out of the worker group for %.0f s: %s", host.name, length,
                  why)

    def by_rank(self) -> dict[int, RemoteHost]:
        return {r: h for h in self.hosts.values() for r in h.ranks}

    # -- the socket ------------------------------------------------------------------------

    async def _send(self, ident: bytes, msg: msgspec.Struct) -> None:
        if self._sock is not None:
            await self._sock.send_multipart([ident, encoder.encode(msg)])

    async def _receive(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            if len(frames) != 2:
                continue
            ident, data = frames[0].bytes, frames[1].bytes
            try:
                msg = decoder.decode(data)
            except msgspec.DecodeError:
                log.warning("ignored an unreadable frame on the join socket")
                continue
            try:
                await self._handle(ident, msg, _peer(frames[1]))
            except Exception:  # one agent's odd message must not end the registry
                log.exception("join socket: handling %s failed", type(msg).__name__)

    async def _handle(self, ident: bytes, msg, peer: str) -> None:
        host = self.hosts.get(ident)
        if host is not None:
            host.seen = time.monotonic()
            match msg:
                case BeatF(group=group, pids=pids) if group and group == host.group:
                    host.pids = pids
                case LostF(group=group, rank=rank, why=why) if group == host.group:
                    log.error("worker rank %d on host %s %s", rank, host.name, why)
                    self._lose(host, f"worker rank {rank} on host {host.name} {why}")
                case ByeF(why=why):
                    self._drop(host, f"host {host.name} left: {why}")
            return
        if isinstance(msg, JoinHelloF):
            await self._challenge(ident, msg, peer)
        elif isinstance(msg, ProofF):
            await self._admit(ident, msg)

    async def _challenge(self, ident: bytes, hello: JoinHelloF, peer: str) -> None:
        bad = [d for d in hello.devices if d.partition(":")[0] not in _DEVICE_NAMES]
        if not hello.devices or bad:
            await self._send(ident, RefusedF(f"devices must be cpu or cuda:N, got "
                                             f"{hello.devices}"))
            return
        until, _, why = self._banned.get(hello.host, (0.0, 0.0, ""))
        if until > time.time():
            await self._send(ident, RefusedF(f"left out for now: {why}", until - time.time()))
            return
        if ident not in self._pending:
            mine = sum(1 for p in self._pending.values() if p[3] == peer)
            if mine >= _PENDING_PER_PEER or len(self._pending) >= _PENDING_MAX:
                await self._send(ident, RefusedF("too many joins wait for their proof; trying "
                                                 "again", retry_s=5.0))
                return
        nonce = secrets.token_bytes(32)
        self._pending[ident] = (nonce, hello, time.monotonic(), peer)
        await self._send(ident, ChallengeF(nonce))

    async def _admit(self, ident: bytes, msg: ProofF) -> None:
        pending = self._pending.pop(ident, None)
        if pending is None:
            return
        nonce, hello, _, _ = pending
        if not check_proof(self.token, nonce, msg.mac):
            log.warning("refused host %r (pid %d): wrong join token", hello.host, hello.pid)
            await self._send(ident, RefusedF("wrong join token"))
            return
        host = RemoteHost(ident, hello.host, list(hello.devices), hello.pid)
        self.hosts[ident] = host
        await self._send(ident, WelcomeF(self.beat_s, self.settings.heartbeat_s))
        log.info("host %s joined with %d device(s): %s", host.name, len(host.devices),
                 ",".join(host.devices))
        self._changed.set()
        self.on_join(host)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.beat_s)
            now = time.monotonic()
            for host in list(self.hosts.values()):
                if now - host.seen > self.settings.heartbeat_s:
                    self._drop(host, f"host {host.name} sent nothing for "
                                     f"{self.settings.heartbeat_s:.0f} s")
                else:
                    await self._send(host.ident, BeatF(host.group))
            for ident, (_, _, at, _) in list(self._pending.items()):
                if now - at > _PENDING_S:
                    self._pending.pop(ident, None)

    def _lose(self, host: RemoteHost, why: str) -> None:
        if host.lost is not None and not host.lost.done():
            host.lost.set_result(why)

    def _drop(self, host: RemoteHost, why: str) -> None:
        self.hosts.pop(host.ident, None)
        log.warning("%s; it is out of the worker group until it joins again", why)
        self._lose(host, why)
