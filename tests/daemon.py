"""Start a real `twinkled serve` subprocess for end-to-end tests, and make API keys."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    """A free port below the kernel's ephemeral range (32768 up on Linux). A port the kernel
    picks itself (bind to 0) can be handed next to any process binding to 0, such as another
    test's worker sockets: a daemon restarted on its old port (the chaos test) then found a
    ZeroMQ socket there. Ports here are only ever taken on purpose."""
    pick = random.SystemRandom()
    for _ in range(200):
        port = pick.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


def make_key(data_dir: Path, tenant: str) -> str:
    """What `twinkled ctl --data-dir DIR --create keys create --tenant T` does (through the
    admin API of a daemon running there, else in the data dir, private), in this process:
    ctl's own code less a Python start-up (~0.7 s of CPU a key, some 80 keys a suite)."""
    from twinkled.server.ctl import Target
    from twinkled.server.perms import private_umask

    old = private_umask()  # as ctl itself: what it writes in the data dir is private
    try:
        return Target(data_dir, None, None, create=True).call("keys_create",
                                                               tenant=tenant)["key"]
    finally:
        os.umask(old)



def ctl_status(data_dir: Path) -> dict:
    """What `twinkled ctl --data-dir DIR status --json` prints, by ctl's own code in this
    process: for polls, a Python start-up less each time."""
    from twinkled.server.ctl import Target

    return Target(data_dir, None, None).call("status")


def daemon_workers(data_dir: Path) -> list[int]:
    """Pids of the live local workers of the daemon running in `data_dir` (none if it does
    not answer)."""
    try:
        workers = ctl_status(data_dir)["workers"]
    except Exception:
        return []
    return [w["pid"] for w in workers if w["alive"] and not w["remote"]]


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace: float = 30) -> None:
    """Send `sig`, wait up to `grace` seconds, then SIGKILL; the process is reaped."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

class Daemon:
    """`twinkled serve` on a free port; waits for the model to be loaded."""

    def __init__(self, model_dir: Path, data_dir: Path, log_path: Path, *extra: str,
                 wait: bool = True, port: int | None = None, env: dict | None = None,
                 session: bool = False):
        self.data_dir = data_dir
        self.port = port or free_port()  # the same port again: clients keep their base_url
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "ab")  # noqa: SIM115 - kept open for the process's life
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "twinkled", "serve", "--model", str(model_dir),
             "--data-dir", str(data_dir), "--port", str(self.port), "--device", "cpu",
             "--dtype", "float32", *extra], stdout=self.log, stderr=subprocess.STDOUT, env=env,
            start_new_session=session)  # session: its own process group, as in a terminal
        if wait:
            try:
                self.wait_ready()
            except BaseException:  # no daemon left behind for the next tests to trip over
                self.stop()
                raise

    def health(self) -> dict | None:
        import json

        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/healthz", timeout=2) as r:
                return json.loads(r.read())
        except OSError:
            return None

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"twinkled exited with {self.proc.returncode}")
            h = self.health()
            if h and h["status"] == "ok":
                return
            if h and h["status"] == "failed":
                raise RuntimeError(f"twinkled could not load its model: {h.get('error')}")
            time.sleep(0.2)
        raise TimeoutError("twinkled did not become ready")

    def workers(self) -> list[int]:
        """Pids of the daemon's live local worker processes, as `ctl status` says (forked
        from a zygote, they are no children of the daemon's); none if it does not answer."""
        return daemon_workers(self.data_dir)

    def wait_workers(self, n: int, old: set[int] = frozenset(), timeout: float = 120) -> list[int]:
        """Wait until `n` workers run, none of them in `old`, and the daemon is ready."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            pids = self.workers()
            h = self.health()
            if len(pids) == n and not set(pids) & set(old) and h and h["status"] == "ok":
                return pids
            time.sleep(0.2)
        raise TimeoutError(f"workers did not come back: {self.workers()}")

    def metric(self, name: str, **labels: str) -> float:
        """The sum of /metrics samples called `name` whose labels include `labels`."""
        import re

        text = urllib.request.urlopen(f"{self.url}/metrics", timeout=10).read().decode()
        total = 0.0
        for m in re.finditer(rf"^{re.escape(name)}(?:\{{(.*?)\}})?\s+(\S+)$", text, re.M):
            have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(1) or ""))
            if all(have.get(k) == v for k, v in labels.items()):
                total += float(m.group(2))
        return total

    def stop(self, sig: int = signal.SIGTERM) -> None:
        stop_process(self.proc, sig)
        self.log.close()


def run_ctl(data_dir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`twinkled ctl --data-dir DIR ARGS` run in this process through click's runner: the
    same output and exit status as the command, without a Python start (~0.7 s of CPU) for
    each of the suite's dozens of calls. An error inside ctl propagates as itself."""
    from click.testing import CliRunner

    from twinkled.server.cli import main

    argv = ["ctl", "--data-dir", str(data_dir), *args]
    r = CliRunner().invoke(main, argv)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    done = subprocess.CompletedProcess(argv, r.exit_code, r.stdout, r.stderr)
    if check:
        done.check_returncode()
    return done


# -- stray bytes on a starting daemon's worker socket (suiteA2) -----------------------------
def listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on (from /proc: its sockets' inodes)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def send_stray_bytes_while_starting(d: Daemon, timeout: float = 60) -> set[int]:
    """Bytes from a stray local client on every port a daemon started with wait=False opens
    beside its HTTP one (its workers' socket), while the workers load the model: the ports
    written to. Any local process can connect there; a stray HTTP client's bytes (seen in the
    suite: a tinker client still heartbeating to a port a new daemon's worker socket had
    taken) arrive as a message of several parts, which once failed the start."""
    sent, deadline = set(), time.time() + timeout
    while not sent and time.time() < deadline:
        for port in listening_ports(d.proc.pid) - {d.port}:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                # As ZeroMQ reads bytes with no greeting (its unversioned framing: a length
                # byte, a flags byte, the body): an identity, then a message of three parts
                s.sendall(b"\x01\x00" + b"\x02\x01a" + b"\x02\x01b" + b"\x02\x00c")
                time.sleep(0.3)
            sent.add(port)
        time.sleep(0.02)
    return sent
