"""The head's side of remote hosts: who has joined, who is alive, what they run.

Torch-free; runs on the daemon's event loop. One ROUTER on `join_listen` talks to every
host agent (`twinkled worker --join`, host.py). A host is taken in only after it proves it
holds the join token (challenge/response, join.py). Liveness cannot come from exit codes
on another machine, so it comes from messages: the agent reports a rank that exited
(LostF), says goodbye, or falls silent for `heartbeat_s`. Each of these resolves the
host's `lost` futures (one per worker group it runs), which each group waits on next to
its local processes. A host that brings lanes runs one group per lane (remote_lanes.py);
`on_join` and `on_drop` tell who keeps track of them.
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


def host_registry(config) -> HostRegistry | None:
    """The daemon's registry of joined hosts (one for its lanes and groups); None when no
    host may join. A head with several lanes of its own takes hosts as lanes only."""
    settings = join_settings(config)
    if settings is None:
        return None
    return HostRegistry(settings, zmq.asyncio.Context(), takes_ranks=config.lanes == 1)


@dataclass
class RemoteHost:
    ident: bytes  # the agent's socket identity
    name: str
    devices: list[str]
    pid: int
    lanes: list[list[str]] = field(default_factory=list)  # [] : it brings ranks, not lanes
    seen: float = field(default_factory=time.monotonic)
    joined: float = field(default_factory=time.time)
    # the worker groups it runs ranks of: group id -> resolves with why, if it loses them
    groups: dict[str, asyncio.Future] = field(default_factory=dict)


class HostRegistry:
    def __init__(self, settings: JoinSettings, ctx: zmq.asyncio.Context,
                 takes_ranks: bool = True):
        """`takes_ranks`: whether a host without lanes may join (its devices become ranks
        of the head's worker group); a head with several lanes of its own takes lanes only."""
        self.settings = settings
        self.token = ensure_token(settings.token_file)
        self.takes_ranks = takes_ranks
        self.hosts: dict[bytes, RemoteHost] = {}  # joined and authenticated, in join order
        # told of every host taken in, and of every host lost (with why)
        self.on_join: list[Callable[[RemoteHost], None]] = []
        self.on_drop: list[Callable[[RemoteHost, str], None]] = []
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
        """The hosts that may run ranks of the head's group now, in the order they joined
        (not those that bring lanes)."""
        now = time.time()
        return [h for h in self.hosts.values()
                if not h.lanes and self._banned.get(h.name, (0,))[0] <= now]

    def rank_plan(self, tp: int) -> list[tuple[RemoteHost, list[str]]]:
        """The ready hosts, each with the devices it runs ranks of the head's group on."""
        plan = []
        for host in self.ready():
            # A tensor-parallel group never spans hosts: a host brings whole groups of tp
            # ranks (its spare devices idle), or none.
            devices = host.devices[:len(host.devices) // tp * tp]
            if not devices:
                log.warning("host %s brings %d device(s), fewer than tp=%d: left out",
                            host.name, len(host.devices), tp)
                continue
            plan.append((host, devices))
        return plan

    def lane_host(self, name: str) -> RemoteHost | None:
        """The joined host called `name` that brings lanes (None when it is not here)."""
        return next((h for h in self.hosts.values() if h.lanes and h.name == name), None)

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

    async def assign(self, host: RemoteHost, group: str, ranks: list[int], devices: list[str],
                     world: int, step_port: int, dist_port: int,
                     options: dict) -> asyncio.Future:
        """Tell `host` to run `ranks` of `group` on `devices`; the future resolves with why,
        if it loses them."""
        lost = host.groups[group] = asyncio.get_running_loop().create_future()
        await self._send(host.ident, AssignF(group, ranks, devices, world, step_port,
                                             dist_port, options))
        return lost

    async def release(self, group: str) -> None:
        """Every host stops the ranks of `group` it runs (the group restarts or stops)."""
        for host in self.hosts.values():
            lost = host.groups.pop(group, None)
            if lost is not None:
                await self._send(host.ident, StopF(group))
                if not lost.done():
                    lost.cancel()

    def ban(self, host: RemoteHost, why: str) -> None:
        """Keep a host whose ranks failed to start out of the next (re)starts for a while
        (doubling each time), so one broken host cannot keep the group from coming up."""
        length = min(_BAN_S[1], 2 * self._banned[host.name][1]) if host.name in self._banned \
            else _BAN_S[0]
        self._banned[host.name] = (time.time() + length, length, why)
        log.error("host %s is left out of the worker group for %.0f s: %s", host.name, length,
                  why)

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
                case LostF(group=group, rank=rank, why=why) if group in host.groups:
                    log.error("worker rank %d on host %s %s", rank, host.name, why)
                    self._lose(host, f"worker rank {rank} on host {host.name} {why}", group)
                case ByeF(why=why):
                    self._drop(host, f"host {host.name} left: {why}")
            return
        if isinstance(msg, JoinHelloF):
            await self._challenge(ident, msg, peer)
        elif isinstance(msg, ProofF):
            await self._admit(ident, msg)

    async def _challenge(self, ident: bytes, hello: JoinHelloF, peer: str) -> None:
        why = self._unfit(hello)
        if why:
            await self._send(ident, RefusedF(why))
            return
        if hello.lanes and self.lane_host(hello.host) is not None:  # (lanes go by name)
            await self._send(ident, RefusedF(f"a host named {hello.host!r} is joined already "
                                             "(its lanes are known by name)", retry_s=5.0))
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

    def _unfit(self, hello: JoinHelloF) -> str:
        """Why this head cannot take `hello`'s host ("" when it can)."""
        devices = [d for lane in hello.lanes for d in lane] + hello.devices
        if not hello.devices or any(d.partition(":")[0] not in _DEVICE_NAMES for d in devices):
            return f"devices must be cpu or cuda:N, got {hello.devices}"
        if any(not lane for lane in hello.lanes):
            return "a lane needs one device or more"
        if not hello.lanes and not self.takes_ranks:
            return ("this daemon takes hosts as lanes: start the agent with --lanes N (its "
                    "devices split into N worker groups)")
        return ""

    async def _admit(self, ident: bytes, msg: ProofF) -> None:
        pending = self._pending.pop(ident, None)
        if pending is None:
            return
        nonce, hello, _, _ = pending
        if not check_proof(self.token, nonce, msg.mac):
            log.warning("refused host %r (pid %d): wrong join token", hello.host, hello.pid)
            await self._send(ident, RefusedF("wrong join token"))
            return
        host = RemoteHost(ident, hello.host, list(hello.devices), hello.pid, hello.lanes)
        self.hosts[ident] = host
        await self._send(ident, WelcomeF(self.beat_s, self.settings.heartbeat_s))
        log.info("host %s joined with %d device(s): %s%s", host.name, len(host.devices),
                 ",".join(host.devices), f" in {len(host.lanes)} lane(s)" if host.lanes else "")
        self._changed.set()
        for tell in self.on_join:
            tell(host)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.beat_s)
            now = time.monotonic()
            for host in list(self.hosts.values()):
                if now - host.seen > self.settings.heartbeat_s:
                    self._drop(host, f"host {host.name} sent nothing for "
                                     f"{self.settings.heartbeat_s:.0f} s")
                else:
                    await self._send(host.ident, BeatF())
            for ident, (_, _, at, _) in list(self._pending.items()):
                if now - at > _PENDING_S:
                    self._pending.pop(ident, None)

    def _lose(self, host: RemoteHost, why: str, group: str | None = None) -> None:
        """The ranks of `group` on `host` (of every group it runs, by default) are gone."""
        for name, lost in host.groups.items():
            if (group is None or name == group) and not lost.done():
                lost.set_result(why)

    def _drop(self, host: RemoteHost, why: str) -> None:
        self.hosts.pop(host.ident, None)
        log.warning("%s; it is out of the worker group%s until it joins again", why,
                    "s of its lanes" if host.lanes else "")
        for tell in self.on_drop:  # first: its lanes' runs go elsewhere before their
            tell(host, why)  # failed steps are answered (remote_lanes.py)
        self._lose(host, why)
