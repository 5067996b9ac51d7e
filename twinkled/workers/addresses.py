"""Where the daemon's sockets listen and how ranks reach them: the step socket (ZeroMQ) and
torch.distributed's rendezvous."""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .hosts import JoinSettings


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (the OS's pick)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def reachable(bind_host: str) -> str:
    """The address local ranks use for a socket bound on `bind_host`."""
    return "127.0.0.1" if bind_host in ("0.0.0.0", "*", "") else \
        "[::1]" if bind_host in ("::", "[::]") else bind_host


def bind_host(join: JoinSettings | None) -> str:
    """Where the step socket and the rendezvous listen: loopback unless hosts may join,
    then the join address's interface (remote ranks connect to them too)."""
    if join is None:
        return "127.0.0.1"
    host = join.bind_host
    return "0.0.0.0" if host == "*" else host.strip("[]") if host.startswith("[") else host
