"""Worker processes forked from a zygote (twinkled/workers/zygote.py, launch.py): a fork
runs what a fresh `python` would (its environment, working directory, output, exit code),
with torch already imported; it dies when the daemon that asked for it goes (its connection
closes) or when the zygote does; a request the zygote's imports would not suit is refused
by name, and the daemon then forks from a zygote of its own, or spawns afresh.

The daemon-level checks (a killed daemon leaves no worker behind, a killed worker is
restarted) run in test_workers.py, test_durability.py and others, whose daemons fork their
ranks from this test process's zygote (conftest.py)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time

import pytest

from twinkled.workers import launch
from twinkled.workers.launch import Forked, Launcher, worker_env

PROBE = ("import os, random, sys; print('torch' in sys.modules, os.environ.get('PROBE'), "
         "os.getcwd(), os.environ.get('TWINKLED_FORKED_BY'), random.random()); sys.exit(3)")


def _gone(pid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


async def _probe(launcher: Launcher, env: dict[str, str]) -> tuple[object, list[str], int]:
    p = await launcher.spawn(["-c", PROBE], env, piped=True)
    out = (await p.stdout.read()).decode().split()
    return p, out, await p.wait()


def test_a_fork_runs_as_a_fresh_python_would_with_torch_imported(tmp_path, monkeypatch):
    assert os.environ.get(launch.ENV)  # (conftest.py started this process's zygote)
    monkeypatch.chdir(tmp_path)

    async def run():
        launcher = Launcher()
        env = {**worker_env(), "PROBE": "hello"}
        a, out_a, code_a = await _probe(launcher, env)
        b, out_b, _ = await _probe(launcher, env)
        own = launcher._own  # (none: the shared zygote forked both)
        await launcher.stop()
        return a, out_a, code_a, out_b, own

    a, out, code, other, own = asyncio.run(run())
    assert isinstance(a, Forked) and code == 3 and own is None
    assert out[:3] == ["True", "hello", str(tmp_path)]  # torch already there; env; cwd
    assert int(out[3]) != os.getpid()  # its parent: the zygote
    assert out[4] != other[4]  # each fork draws its own random numbers (os.fork reseeds)


def test_a_fork_dies_when_its_daemon_goes_or_its_zygote_does(monkeypatch):
    async def run():
        launcher = Launcher()
        p = await launcher.spawn(["-c", "import time; time.sleep(60)"], worker_env(),
                                 piped=False)
        p._writer.close()  # as a killed daemon's end closes
        closed = await asyncio.to_thread(_gone, p.pid)
        # A zygote of its own (the shared one refuses this environment), then stopped.
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        own = Launcher()
        q = await own.spawn(["-c", "import time; time.sleep(60)"], worker_env(), False)
        await own.stop()
        return closed, q

    closed, q = asyncio.run(run())
    assert closed
    assert isinstance(q, Forked) and _gone(q.pid)


def test_an_unsuited_environment_is_refused_by_name_then_forked_elsewhere(monkeypatch):
    shared = os.environ[launch.ENV]

    async def run():
        launcher = Launcher()
        env = {**worker_env(), "TRITON_INTERPRET": "0", "PROBE": "x"}
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            await launcher._fork(shared, ["-c", "pass"], env, False)
        p, out, code = await _probe(launcher, env)  # falls back to a zygote of its own
        await launcher.stop()
        return p, out, code

    p, out, code = asyncio.run(run())
    assert isinstance(p, Forked) and code == 3 and out[1] == "x"


def test_zygote_off_spawns_afresh(monkeypatch):
    monkeypatch.setenv(launch.ENV, "off")

    async def run():
        launcher = Launcher()
        p, out, code = await _probe(launcher, {**worker_env(), "PROBE": "y"})
        p2 = await launcher.spawn(["-c", "import time; time.sleep(60)"], worker_env(),
                                  False)
        p2.send_signal(signal.SIGKILL)
        return p, out, code, await p2.wait()

    p, out, code, killed = asyncio.run(run())
    assert isinstance(p, asyncio.subprocess.Process) and code == 3
    assert out[:2] == ["False", "y"] and killed == -signal.SIGKILL


def test_a_bad_request_is_refused_and_the_zygote_serves_on():
    path = os.environ[launch.ENV]
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:  # (it binds once ready)
        time.sleep(0.1)
    ok = {"argv": ["-c", "pass"], "env": worker_env()}
    for fds, body, why in (([0], ok, "file descriptors"),
                           ([0, 1, 2], {"argv": ["-c", "pass"]}, "env"),
                           ([0, 1, 2], "not an object", "TypeError"),
                           # a caller in another network namespace: a fork would be in ours
                           ([0, 1, 2], {**ok, "namespaces": {"net": "net:[1]"}},
                            "namespaces differ from the zygote's: net")):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)
            socket.send_fds(s, [json.dumps(body).encode()], fds)
            answer = json.loads(s.makefile().readline())
        assert "pid" not in answer and why in answer["error"], answer

    async def run():
        launcher = Launcher()
        p, out, code = await _probe(launcher, {**worker_env(), "PROBE": "z"})
        own = launcher._own  # (none started: the shared one answered)
        await launcher.stop()
        return p, out, code, own

    p, out, code, own = asyncio.run(run())
    assert isinstance(p, Forked) and code == 3 and out[1] == "z" and own is None


@pytest.mark.parametrize("parent", [True, False])
def test_a_zygote_whose_folder_is_gone_says_so_only_where_an_operator_started_it(tmp_path,
                                                                                  parent):
    """A zygote bound to a parent (a daemon's own, a test process's) whose socket folder went
    while it imported (the parent ending) exits quietly, no traceback; one an operator started
    (no --parent) fails with the error, naming the path."""
    import subprocess
    import sys

    path = str(tmp_path / "gone" / "zygote.sock")
    argv = [sys.executable, "-m", "twinkled.workers.zygote", path, "--preload", "json"]
    if parent:
        argv += ["--parent", str(os.getpid())]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if parent:
        assert run.returncode == 0 and run.stderr == "", run.stderr[-2000:]
    else:
        assert run.returncode != 0 and path in run.stderr and "does not exist" in run.stderr
