"""Starting worker processes: forked from a zygote (`zygote.py`: torch and transformers
already imported) when one can be had, else spawned afresh. The daemon side, torch-free.

`Launcher.spawn` gives an object with what the supervisor uses of an
`asyncio.subprocess.Process`: `pid`, `returncode`, `stdout` (when piped), `wait()`,
`send_signal()`, `terminate()`, `kill()`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

from twinkled.protocol.logs import relay
from twinkled.workers.launch_sync import ENV, exit_code, request_fork

log = logging.getLogger("twinkled.workers")

START_TIMEOUT_S = 120.0  # its imports take ~5 s of CPU; a loaded box may stretch that
SHARED_WAIT_S = 30.0  # for a shared zygote's socket to appear (it binds once imported)


class Forked:
    """A child of a zygote, as the supervisor sees its own children: its pid, its exit
    code once it exited (the zygote reports it over the connection the request came on,
    which holds the child's life: closing it kills the child)."""

    def __init__(self, pid: int, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, stdout: asyncio.StreamReader | None):
        self.pid = pid
        self.returncode: int | None = None
        self.stdout = stdout
        self._writer = writer
        self._exited = asyncio.ensure_future(self._watch(reader))

    async def _watch(self, reader: asyncio.StreamReader) -> None:
        self.returncode = exit_code(await reader.readline())
        self._writer.close()

    async def wait(self) -> int:
        await asyncio.shield(self._exited)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Launcher:
    """Where a daemon's workers come from: a shared zygote (`TWINKLED_ZYGOTE`, if its
    environment matches), else one of its own (started at the first spawn, kept across
    group restarts, stopped with the daemon), else plain spawns (the zygote would not
    start; said once in the log)."""

    def __init__(self, preload: list[str] | None = None):
        self.preload = preload or []
        shared = os.environ.get(ENV) or None
        self._shared = None if shared == "off" else shared
        self._own: asyncio.subprocess.Process | None = None
        self._own_path: str | None = None
        self._relay: asyncio.Future | None = None  # (held: a task nothing holds may go)
        self._dir: tempfile.TemporaryDirectory | None = None
        self._failed = shared == "off"

    async def spawn(self, argv: list[str], env: dict[str, str], piped: bool):
        """Start `python argv...` with `env`, in a session of its own; `piped`: its
        stdout and stderr come back as one stream (`.stdout`)."""
        if self._shared:
            try:
                return await self._fork(self._shared, argv, env, piped)
            except (OSError, ValueError) as e:
                log.info("the shared worker zygote %s is not used: %s", self._shared, e)
                self._shared = None
        path = await self._own_zygote(env, piped)
        if path is not None:
            try:
                return await self._fork(path, argv, env, piped)
            except (OSError, ValueError) as e:
                log.warning("the worker zygote failed (%s): starting workers afresh", e)
                self._failed = True
        return await asyncio.create_subprocess_exec(
            sys.executable, *argv, env=env, start_new_session=True, limit=1 << 20,
            stdout=asyncio.subprocess.PIPE if piped else None,
            stderr=asyncio.subprocess.STDOUT if piped else None)

    async def _fork(self, path: str, argv: list[str], env: dict[str, str], piped: bool):
        loop = asyncio.get_running_loop()
        # A shared zygote that is still importing has no socket yet (it binds once ready).
        deadline = time.monotonic() + SHARED_WAIT_S
        while not os.path.exists(path) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        read_fd, write_fd = os.pipe() if piped else (None, None)
        null = os.open(os.devnull, os.O_RDONLY)
        try:
            out = write_fd if piped else sys.stdout.fileno()
            err = write_fd if piped else sys.stderr.fileno()
            conn, pid = request_fork(path, argv, env, (null, out, err))  # (ms: it forks)
        except BaseException:
            if read_fd is not None:
                os.close(read_fd)
            raise
        finally:
            os.close(null)
            if write_fd is not None:
                os.close(write_fd)
        conn.setblocking(False)
        reader, writer = await asyncio.open_unix_connection(sock=conn, limit=1 << 16)
        stdout = None
        if read_fd is not None:
            stdout = asyncio.StreamReader(limit=1 << 20, loop=loop)
            await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdout),
                                         os.fdopen(read_fd, "rb", 0))
        return Forked(pid, reader, writer, stdout)

    async def _own_zygote(self, env: dict[str, str], piped: bool) -> str | None:
        """This daemon's zygote (with the workers' environment): started at the first
        call, again if it died. `piped`: its output comes through the daemon's log (JSON
        mode), as its workers' does."""
        if self._failed:
            return None
        if self._own is not None and self._own.returncode is None:
            return self._own_path
        self._dir = self._dir or tempfile.TemporaryDirectory(prefix="twinkled-zygote-")
        self._own_path = str(Path(self._dir.name) / "zygote.sock")
        extra = [a for m in self.preload for a in ("--preload", m)]
        try:
            self._own = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "twinkled.workers.zygote", self._own_path,
                "--parent", str(os.getpid()), *extra, env=env, start_new_session=True,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE if piped else None,
                stderr=asyncio.subprocess.STDOUT if piped else None)
            if piped:
                self._relay = asyncio.ensure_future(relay(self._own.stdout, "twinkled.zygote"))
        except OSError as e:
            log.warning("worker zygote did not start (%s): starting workers afresh", e)
            self._failed = True
            return None
        if await self._ready(self._own, self._own_path):
            return self._own_path
        log.warning("worker zygote did not come up: starting workers afresh")
        self._failed = True
        return None

    @staticmethod
    async def _ready(proc: asyncio.subprocess.Process, path: str) -> bool:
        """Whether the zygote listens (once its imports are done), within the timeout."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and proc.returncode is None:
            try:
                probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    probe.connect(path)
                    return True
                finally:
                    probe.close()
            except OSError:
                await asyncio.sleep(0.05)
        return False

    async def stop(self) -> None:
        """Stop this daemon's own zygote (its children were stopped before)."""
        if self._own is not None and self._own.returncode is None:
            self._own.kill()
            await self._own.wait()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None


def worker_env() -> dict[str, str]:
    """A rank's environment: the daemon's, unbuffered, without progress bars (a log is no
    tty). A zygote of the daemon's own is started with the same."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def arch_preload(model: str | None) -> list[str]:
    """The transformers modeling module of the model's architecture (for the zygote to
    import; a name that is not one is skipped there)."""
    try:
        kind = json.loads((Path(model) / "config.json").read_text())["model_type"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [f"transformers.models.{kind}.modeling_{kind}"] if str(kind).isidentifier() else []
