"""The host agent: `twinkled worker --join tcp://HEAD:PORT --devices ...` on another machine.

It joins the daemon's worker group on behalf of this host's devices: connects to the head's
join socket, proves it holds the join token, and then runs whatever ranks the head assigns,
as the same `twinkled.workers.worker` processes the daemon spawns locally, pointed at the
head's step socket and rendezvous. It is their parent, so they die with it (PDEATHSIG).

Liveness both ways is by messages, since neither side can see the other's processes: a
rank that exits is reported (LostF) and the head restarts the group; the head's silence
for `silence_s` (it crashed, the network went) makes the agent kill its ranks, so no
orphan holds a GPU, and try to join again until it can: systemd-friendly, it never exits
for a lost head. It exits (code 2) only when the head refuses its token.

With `--lanes N` it brings this host's devices as N lanes, one worker group each, which
the head starts, stops and restarts one at a time (core/remote_lanes.py): it then runs
several groups at once.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path

import zmq

from .addresses import free_port
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
    decoder,
    encoder,
    proof,
    split_endpoint,
)
from .launch import worker_env
from .launch_sync import AgentLauncher, ForkedSync

log = logging.getLogger("twinkled.host")
REFUSED = 2  # exit code: the head refused this host's token (retrying cannot help)
_ANSWER_S = 10.0  # how long to wait for the head's challenge and welcome


class Agent:
    def __init__(self, join: str, devices: list[str], token: bytes, model: str | None = None,
                 name: str | None = None, lanes: int = 0):
        self.join = join
        self.head, _ = split_endpoint(join)
        self.devices = devices
        self.token = token
        self.model = model
        self.name = name or socket.gethostname()
        # `lanes` equal slices of the devices (0: they join the head's group as ranks)
        per = len(devices) // lanes if lanes else 0
        self.lanes = [devices[i * per:(i + 1) * per] for i in range(lanes)]
        # (group, rank) -> its process, forked from a zygote where one can be had (launch_sync)
        self.procs: dict[tuple[str, int], subprocess.Popen | ForkedSync] = {}
        self.launcher = AgentLauncher()
        self.reported: set[tuple[str, int]] = set()
        self.stopping = False

    def run(self) -> int:
        """Join, serve, and join again after the head is lost; the exit code."""
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        ctx = zmq.Context()
        delay = 1.0
        try:
            while not self.stopping:
                outcome, retry = self._session(ctx)
                self.kill()
                if outcome == "refused":
                    return REFUSED
                if outcome == "served":
                    delay = 1.0
                if not self.stopping:
                    wait = retry or delay
                    log.info("joining %s again in %.0f s", self.join, wait)
                    self._sleep(wait)
                    delay = min(30.0, 2 * delay)
            return 0
        finally:
            self.kill()
            ctx.destroy(linger=0)

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < end:
            time.sleep(min(0.2, end - time.monotonic()))

    def _session(self, ctx: zmq.Context) -> tuple[str, float]:
        """One connection to the head: ("served" | "unanswered" | "refused" | "stopped",
        seconds to wait before the next try)."""
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, secrets.token_hex(8).encode())  # new per connection
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.join)
        try:
            return self._serve(sock)
        finally:
            sock.close(0)

    def _serve(self, sock: zmq.Socket) -> tuple[str, float]:
        send = lambda msg: sock.send(encoder.encode(msg))  # noqa: E731
        send(JoinHelloF(self.name, self.devices, os.getpid(), self.lanes))
        welcome: WelcomeF | None = None
        heard = time.monotonic()
        beat = 0.0
        while not self.stopping:
            now = time.monotonic()
            silence = welcome.silence_s if welcome else _ANSWER_S
            if now - heard > silence:
                why = "did not answer" if welcome is None else f"was silent for {silence:.0f} s"
                log.warning("the head at %s %s; stopping this host's ranks", self.join, why)
                return ("served" if welcome else "unanswered"), 0.0
            if welcome is not None:
                self._report(send)
                if now - beat >= welcome.beat_s:
                    send(BeatF())
                    beat = now
            if not sock.poll(200):
                continue
            try:
                msg = decoder.decode(sock.recv())
            except Exception as e:  # noqa: BLE001 - an unreadable frame is dropped
                log.warning("ignored an unreadable frame from the head: %s", e)
                continue
            heard = time.monotonic()
            match msg:
                case ChallengeF(nonce=nonce):
                    send(ProofF(proof(self.token, nonce)))
                case WelcomeF():
                    welcome = msg
                    log.info("joined %s with %s", self.join, ",".join(self.devices))
                case RefusedF(reason=reason, retry_s=retry):
                    log.error("the head at %s refused this host: %s", self.join, reason)
                    return ("refused" if retry <= 0 else "unanswered"), retry
                case AssignF():
                    if not self.lanes:  # the head's group restarts whole: one at a time
                        self.kill()
                    self._spawn(msg)
                case StopF(group=group):
                    self.kill(group)
                case ByeF(why=why):
                    log.warning("the head left: %s", why)
                    return "served", 0.0
        send(ByeF("the host agent is stopping"))
        return "stopped", 0.0

    def _spawn(self, a: AssignF) -> None:
        self.kill(a.group)  # (assigned again: its old ranks go first)
        # the cores shared by every rank this host may run at once
        threads = max(1, (os.cpu_count() or 1) // max(1, len(a.ranks), len(self.devices)))
        # A group wholly on this host (a lane) meets here: its rank 0 hosts the rendezvous,
        # which it could not on the head's address; its collectives never leave the host.
        dist_url = f"tcp://127.0.0.1:{free_port()}" if len(a.ranks) == a.world else \
            f"tcp://{self.head}:{a.dist_port}"
        for rank, device in zip(a.ranks, a.devices, strict=True):
            args = {**a.options, "rank": rank, "world": a.world, "device": device,
                    "group": a.group, "threads": threads,
                    "endpoint": f"tcp://{self.head}:{a.step_port}", "dist_url": dist_url}
            if self.model:
                args["model"] = self.model
            self.procs[a.group, rank] = self.launcher.spawn(
                ["-m", "twinkled.workers.worker", json.dumps(args)], worker_env())
        log.info("running rank(s) %s of %d (group %s)", a.ranks, a.world, a.group)

    def _report(self, send) -> None:
        """Tell the head about each rank that exited (once): it restarts that group."""
        for (group, rank), p in self.procs.items():
            if p.poll() is not None and (group, rank) not in self.reported:
                self.reported.add((group, rank))
                log.error("worker rank %d (pid %d) exited with code %s", rank, p.pid,
                          p.returncode)
                send(LostF(group, rank, f"(pid {p.pid}) exited with code {p.returncode}"))

    def kill(self, group: str | None = None) -> None:
        """SIGKILL this host's ranks (of `group`; all by default: one may be stuck in a
        collective) and reap them."""
        doomed = {k: p for k, p in self.procs.items() if group is None or k[0] == group}
        for p in doomed.values():
            if p.poll() is None:
                p.kill()
        for key, p in doomed.items():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                log.error("worker pid %d did not die", p.pid)
            del self.procs[key]
            self.reported.discard(key)


def main(join: str, devices: list[str], token_file: Path, model: str | None,
         name: str | None, lanes: int = 0) -> int:
    """`twinkled worker`: the exit code (0 after SIGTERM, 2 when the token is refused)."""
    from .join import read_token

    logging.basicConfig(level=logging.INFO, format="%(asctime)s twinkled.host %(message)s")
    return Agent(join, devices, read_token(token_file), model, name, lanes).run()
