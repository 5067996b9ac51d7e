"""What the daemon (the head) and a host agent (`twinkled worker --join`) say to each other.

Torch-free. The agent's DEALER connects to the head's join ROUTER (`join_listen`):

    agent: JoinHelloF(host, devices, lanes) head: ChallengeF(nonce)
    agent: ProofF(HMAC-SHA256(token, nonce))
    head:  WelcomeF | RefusedF            (a wrong proof is refused; the token never travels)
    head:  AssignF(group, ranks, ...)     agent spawns those worker ranks, pointed at the head
    both:  BeatF every second             silence for `heartbeat_s`: the other side is gone
    agent: LostF(group, rank, why)        one of its ranks exited: the head restarts the group
    head:  StopF(group)                   the group is restarting or stopping: kill its ranks

A host that announces `lanes` brings lanes (one worker group each, core/remote_lanes.py),
so it runs several groups at once, each assigned and stopped on its own; a host without
brings its devices as ranks of the head's own group.

Step frames do not pass through here: the remote ranks talk to the head's step ROUTER
directly, like local ranks (frames.py).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

import msgspec


class JoinHelloF(msgspec.Struct, tag="join"):
    host: str  # the agent's host name (what `twinkled ctl status` shows)
    devices: list[str]
    pid: int
    # The host's devices split into lanes (its own `--lanes`): one worker group each. Empty:
    # its devices join the head's worker group as ranks (data parallelism across hosts).
    lanes: list[list[str]] = []


class ChallengeF(msgspec.Struct, tag="challenge"):
    nonce: bytes


class ProofF(msgspec.Struct, tag="proof"):
    mac: bytes  # proof(token, nonce)


class WelcomeF(msgspec.Struct, tag="welcome"):
    beat_s: float  # how often the head beats (and wants the agent to)
    silence_s: float  # no message for this long: the other side is gone


class RefusedF(msgspec.Struct, tag="refused"):
    reason: str
    retry_s: float = 0.0  # 0: do not retry (a wrong token); else try again after this long


class AssignF(msgspec.Struct, tag="assign"):
    """Run these ranks of the group. Addresses are ports only: the agent reaches the head at
    the address it joined through, whatever interface the head bound."""

    group: str
    ranks: list[int]
    devices: list[str]  # one per rank, from the devices the agent announced
    world: int
    step_port: int  # the head's step ROUTER
    dist_port: int  # torch.distributed rendezvous (TCPStore on the head's rank 0)
    options: dict  # the worker options of the group (model, dtype, max_rank, ...)


class StopF(msgspec.Struct, tag="stop"):
    group: str


class BeatF(msgspec.Struct, tag="beat"):
    group: str = ""
    pids: dict[int, int] = {}  # rank -> pid of the agent's live ranks


class LostF(msgspec.Struct, tag="lost"):
    group: str
    rank: int
    why: str


class ByeF(msgspec.Struct, tag="bye"):
    why: str


JoinMsg = (JoinHelloF | ChallengeF | ProofF | WelcomeF | RefusedF | AssignF | StopF | BeatF
           | LostF | ByeF)
encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(JoinMsg)


def proof(token: bytes, nonce: bytes) -> bytes:
    return hmac.new(token, nonce, hashlib.sha256).digest()


def check_proof(token: bytes, nonce: bytes, mac: bytes) -> bool:
    return hmac.compare_digest(proof(token, nonce), mac)  # constant time


def read_token(path: Path) -> bytes:
    """The shared join secret; a missing, empty or short token file is an error, since a
    head that accepted anyone would hand its tenants' data to any host that asks."""
    token = Path(path).read_bytes().strip()
    if len(token) < 16:
        raise ValueError(f"join token file {path} holds fewer than 16 bytes")
    return token


def ensure_token(path: Path) -> bytes:
    """The head's join token, created (owner-only, like the admin key) if there is none:
    copy this file to every host that runs `twinkled worker --join`."""
    path = Path(path)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    return read_token(path)


def split_endpoint(url: str) -> tuple[str, int]:
    """("host", port) of "tcp://host:port" (IPv6 hosts in brackets)."""
    if not url.startswith("tcp://"):
        raise ValueError(f"{url!r} is not tcp://HOST:PORT")
    host, sep, port = url[len("tcp://"):].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{url!r} is not tcp://HOST:PORT")
    return host, int(port)
