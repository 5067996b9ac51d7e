"""Worker processes forked from a zygote, for a synchronous caller: the host agent
(`twinkled worker --join`, host.py), whose ranks otherwise start as fresh processes. The
request itself (`request_fork`) is the daemon's too (launch.py).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys

log = logging.getLogger("twinkled.workers")

ENV = "TWINKLED_ZYGOTE"  # a shared zygote's socket; "off": spawn every worker afresh


def request_fork(path: str, argv: list[str], env: dict[str, str],
                 stdio: tuple[int, int, int], timeout: float = 30.0) -> tuple[socket.socket, int]:
    """Ask the zygote listening at `path` for a child running `python argv...` with `env`
    and `stdio` (stdin, stdout, stderr), in a session of its own: the connection, which
    holds the child's life and brings its exit code, and the child's pid. The zygote answers
    once it forked (milliseconds). Raises OSError, or ValueError with the zygote's reason."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(timeout)
        conn.connect(path)
        umask = os.umask(0o077)  # (read it: there is no other way)
        os.umask(umask)
        request = {"argv": argv, "env": env, "cwd": os.getcwd(), "umask": umask,
                   "executable": sys.executable, "new_session": True,
                   "namespaces": namespaces()}
        socket.send_fds(conn, [json.dumps(request).encode()], list(stdio))
        line = b""
        while not line.endswith(b"\n"):  # byte by byte: the exit line may follow at once
            byte = conn.recv(1)
            if not byte:
                break
            line += byte
        answer = json.loads(line or b"{}")
        if "pid" not in answer:
            raise ValueError(answer.get("error") or "the zygote closed the connection")
        return conn, int(answer["pid"])
    except BaseException:
        conn.close()
        raise


def namespaces() -> dict[str, str]:
    """This process's Linux namespaces (`net:[4026531840]`, ...): a fork lives in its
    zygote's, so a zygote serves only callers that share them (a host agent in a network
    namespace of its own, say, needs its ranks there)."""
    out = {}
    for name in ("net", "mnt", "pid", "ipc", "uts", "user", "cgroup"):
        try:
            out[name] = os.readlink(f"/proc/self/ns/{name}")
        except OSError:
            pass
    return out


def exit_code(line: bytes) -> int:
    """The child's exit code from the zygote's last line (none: the zygote died, and its
    children with it)."""
    try:
        return int(json.loads(line)["exit"])
    except (ValueError, KeyError, TypeError):
        return -signal.SIGKILL


class ForkedSync:
    """A child of a zygote as host.py uses a `subprocess.Popen`: pid, returncode, poll(),
    wait(timeout), kill()."""

    def __init__(self, conn: socket.socket, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn

    def poll(self) -> int | None:
        if self.returncode is None:
            self._conn.setblocking(False)
            try:
                self._settle(self._conn.recv(4096))
            except BlockingIOError:
                pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                self._settle(self._conn.recv(4096))
            except TimeoutError:
                raise subprocess.TimeoutExpired(f"worker pid {self.pid}", timeout) from None
        return self.returncode  # type: ignore[return-value]

    def _settle(self, data: bytes) -> None:
        self.returncode = exit_code(data.split(b"\n", 1)[0])
        self._conn.close()

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class AgentLauncher:
    """The host agent's ranks: from a shared zygote (`TWINKLED_ZYGOTE`) whose environment
    and namespaces suit them, else afresh. No zygote of its own: until a rank restarts it
    would only add its imports to the first rank's (a daemon's ranks restart more often,
    and it keeps one, launch.py)."""

    def __init__(self) -> None:
        shared = os.environ.get(ENV) or None
        self._shared = None if shared == "off" else shared

    def spawn(self, argv: list[str], env: dict[str, str]) -> ForkedSync | subprocess.Popen:
        if self._shared and os.path.exists(self._shared):
            stdio = (os.open(os.devnull, os.O_RDONLY), sys.stdout.fileno(), sys.stderr.fileno())
            try:
                return ForkedSync(*request_fork(self._shared, argv, env, stdio))
            except (OSError, ValueError) as e:
                log.info("the shared worker zygote %s is not used: %s", self._shared, e)
                self._shared = None
            finally:
                os.close(stdio[0])
        return subprocess.Popen([sys.executable, *argv], env=env, start_new_session=True)
