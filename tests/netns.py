"""Network namespaces for "hosts" on one machine: each `twinkled worker --join` agent in a
namespace of its own, reaching the head over a veth pair (10.77.0.0/24) instead of
loopback. Needs root and iproute2; `wire()` says why not where it cannot (the tests then
skip, or fall back to loopback, as each says)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import uuid

HEAD_IP = "10.77.0.1"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Namespaces:
    """Network namespaces `twk-...`, each with one end of a veth pair (10.77.0.2, .3, ...);
    the other ends on a bridge in this namespace that holds the head's address
    (10.77.0.1), so the head's interface outlives a namespace (deleting it deletes its
    whole veth pair), as a real head's does when a worker host dies."""

    def __init__(self, count: int):
        self.tag = uuid.uuid4().hex[:6]
        self.bridge = f"twkb{self.tag}"
        self.hosts: list[tuple[str, str, str]] = []  # (namespace, head-side, host-side)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{HEAD_IP}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(count):
                ns, here, there = (f"twk-{self.tag}{i}", f"twkh{self.tag}{i}",
                                   f"twkn{self.tag}{i}")
                _ip("netns", "add", ns)
                self.hosts.append((ns, here, there))
                _ip("link", "add", here, "type", "veth", "peer", "name", there)
                _ip("link", "set", here, "master", self.bridge)
                _ip("link", "set", there, "netns", ns)
                _ip("link", "set", here, "up")
                for args in (("addr", "add", f"10.77.0.{2 + i}/24", "dev", there),
                             ("link", "set", there, "up"), ("link", "set", "lo", "up")):
                    _ip("netns", "exec", ns, "ip", *args)
        except BaseException:
            self.remove()
            raise

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program on host `i`, with gloo told its
        interface (the host name names no address inside the namespace, so each side
        names the veth end it has, as operators set GLOO_SOCKET_IFNAME)."""
        ns, _, there = self.hosts[i]
        return ["ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={there}"]

    def delete(self, i: int) -> None:
        """Host `i`'s network goes away (its veth pair with it)."""
        subprocess.run(["ip", "netns", "del", self.hosts[i][0]], check=True,
                       capture_output=True)

    def reaches_head(self, i: int) -> bool:
        """A TCP connection from host `i` to the head's address arrives (a bridge that a
        firewall's FORWARD rules drop would not carry the join)."""
        with socket.socket() as server:
            server.bind((HEAD_IP, 0))
            server.listen(1)
            port = server.getsockname()[1]
            probe = subprocess.run(
                [*self.prefix(i), sys.executable, "-c",
                 f"import socket; socket.create_connection(('{HEAD_IP}', {port}), 5)"],
                capture_output=True, timeout=30)
            return probe.returncode == 0

    def remove(self) -> None:
        for ns, here, _ in self.hosts:
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
            subprocess.run(["ip", "link", "del", here], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], check=False, capture_output=True)


def wire(count: int) -> tuple[Namespaces | None, str]:
    """`count` namespaces that reach the head, or None and why not."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        return None, "needs root and iproute2 to create a network namespace"
    try:
        wired = Namespaces(count)
    except (subprocess.CalledProcessError, OSError) as e:
        return None, f"cannot wire network namespaces here: {getattr(e, 'stderr', e)!r}"
    if not all(wired.reaches_head(i) for i in range(count)):
        wired.remove()
        return None, "network namespaces here do not reach the head's bridge"
    return wired, ""
