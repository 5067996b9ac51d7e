"""A warm start for worker processes: a process that has imported torch and transformers'
modeling stack once, and forks each worker rank from there.

A rank's start was ~5 s of CPU on a CPU box before it loaded a single weight, nearly all of
it importing torch (~1.5 s) and transformers' modeling code (~3.5 s: its lazy module map,
torch._dynamo and torch.distributed.tensor, which it imports at module level). A daemon
pays that at every worker (re)start and once per rank; a forked rank pays none of it. The
supervisor starts a zygote of its own (`launch.py`) and keeps it across group restarts, or
uses a shared one named by `TWINKLED_ZYGOTE` (the test suite starts one per test process:
its ~90 worker starts were half the suite's CPU).

    python -m twinkled.workers.zygote SOCKET [--parent PID] [--preload MODULE ...]

Only third-party modules are imported here, never twinkled's own: ours read settings from
the environment at import (fault-injection knobs, say), and a fork must read them from the
environment its daemon gave it. Third-party modules that read the environment at import
(`HF_*`, `TORCH*`, `TRITON*`, `CUDA*`, ...) are the reason a request whose environment
differs from the zygote's there is refused (`IMPORT_ENV`): the daemon then starts a zygote
of its own. Nothing here touches CUDA (a fork after CUDA's start cannot use it), and no
thread of ours runs: the only other threads are the BLAS libraries' pools (OpenBLAS starts
one as torch and scipy load), which stop and start again around a fork (pthread_atfork), so
Python's warning about forking a threaded process is silenced.

Protocol, one UNIX-socket connection per child: the client sends a JSON request (argv after
the interpreter, environment, working directory, umask) with the child's stdin/stdout/stderr file
descriptors attached (SCM_RIGHTS); the zygote answers `{"pid": N}` (or `{"error": why}`),
and when the child exits, `{"exit": code}` (negative: the signal that killed it, as
`asyncio.subprocess.Process.returncode` says). If the client's end closes first, its daemon
is gone: the child is killed (as PR_SET_PDEATHSIG does for a child of the daemon itself).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import selectors
import signal
import socket
import sys
import traceback
import warnings

from twinkled.workers.launch_sync import namespaces  # (reads no settings at import)

# Import-time settings of the preloaded modules: a child must see what the zygote saw.
IMPORT_ENV = ("HF_", "TRANSFORMERS", "TOKENIZERS", "TORCH", "PYTORCH", "TRITON", "CUDA",
              "NCCL", "NVIDIA", "OMP_", "MKL", "KMP_", "OPENBLAS", "PYTHON", "LD_", "XDG_")
PRELOAD = ("torch", "torch.distributed", "transformers", "transformers.modeling_utils",
           "transformers.masking_utils", "transformers.activations",
           "transformers.models.auto.modeling_auto")
MAX_REQUEST = 1 << 20


def import_env(env: dict[str, str]) -> dict[str, str]:
    """The variables of `env` the preloaded modules may have read at import."""
    return {k: v for k, v in env.items() if k.startswith(IMPORT_ENV)}


def env_difference(seen: dict[str, str], theirs: dict[str, str],
                   after: dict[str, str] | None = None) -> list[str]:
    """The import-time variables `theirs` sets otherwise than `seen` did (names only). A
    value some import set itself (`after`: the environment once the imports ran; torch sets
    TORCHINDUCTOR_CACHE_DIR) is as good: a process that imported them has it too."""
    a, b, c = import_env(seen), import_env(theirs), import_env(after or seen)
    return sorted(k for k in a.keys() | b.keys() if b.get(k) not in (a.get(k), c.get(k)))


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the client's closed connection still kills a child
        pass


class Zygote:
    """The serving loop: accept a request, fork, report the child's pid and its exit."""

    def __init__(self, path: str, env: dict[str, str]):
        self.path = path
        self.env = env  # as the preloaded modules saw it (some set variables of their own)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if os.path.exists(path):
            os.unlink(path)
        self.listener.bind(path)
        os.chmod(path, 0o600)  # it runs code as us: nobody else may ask
        self.listener.listen(64)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ)
        self.children: dict[int, socket.socket] = {}  # pid -> its client's connection

    def serve(self) -> None:
        while True:
            for key, _ in self.sel.select(timeout=0.05):
                if key.fileobj is self.listener:
                    try:
                        self._accept()
                    except Exception:  # one request's fault; the children live on with us
                        traceback.print_exc()
                else:
                    self._hung_up(key.fileobj)
            self._reap()

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        conn.settimeout(10)
        fds: list[int] = []
        try:
            msg, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 3)
            if not msg:  # a probe (launch.py: is it up?)
                conn.close()
                return
            request = json.loads(msg)
            differs = env_difference(self.env, request["env"], dict(os.environ))
            if len(fds) != 3:
                raise ValueError(f"3 file descriptors expected (stdin, stdout, stderr), got {len(fds)}")
            if request.get("executable", sys.executable) != sys.executable:
                raise ValueError(f"this zygote runs {sys.executable}")
            if differs:
                raise ValueError("environment differs from the zygote's at import: "
                                 + ", ".join(differs))
            theirs = request.get("namespaces", {})
            apart = sorted(k for k, v in namespaces().items() if theirs.get(k, v) != v)
            if apart:  # (a fork lives in ours: a caller in a network namespace of its own)
                raise ValueError("namespaces differ from the zygote's: " + ", ".join(apart))
        except (OSError, ValueError, KeyError, TypeError) as e:
            return _refuse(conn, fds, f"{type(e).__name__}: {e}")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # (the module's docstring)
                pid = os.fork()
        except OSError as e:  # (out of memory or processes): this request fails, not the
            return _refuse(conn, fds, f"fork failed: {e}")  # zygote, with every child
        if pid == 0:
            self._child(conn, request, fds)  # never returns
        for fd in fds:
            os.close(fd)
        self.children[pid] = conn
        self.sel.register(conn, selectors.EVENT_READ)
        try:
            _send(conn, {"pid": pid})
        except OSError:  # its client is gone already: so is the child (`_hung_up`)
            pass

    def _child(self, conn: socket.socket, request: dict, fds: list[int]) -> None:
        code = 1
        try:
            self.sel.close()
            self.listener.close()
            conn.close()
            for other in self.children.values():
                other.close()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            _die_with_parent()  # the zygote gone: so is every child it forked
            if request.get("new_session"):
                os.setsid()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            added = {k: v for k, v in os.environ.items() if k not in self.env}
            os.environ.clear()
            os.environ.update(request["env"])
            os.environ.update(added)  # what the imports set, as they would have in the child
            # The child's parent is this zygote, not the daemon that asked: a worker's
            # check that its parent lives looks here (worker.py).
            os.environ["TWINKLED_FORKED_BY"] = str(os.getppid())
            os.chdir(request.get("cwd") or "/")
            # What a child of the daemon inherits from it: its umask (private, perms.py).
            os.umask(int(request.get("umask", 0o077)))
            code = _run(request["argv"])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int | None):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            os._exit(code)

    def _hung_up(self, conn: socket.socket) -> None:
        """A client's connection is readable: it closed (it sends nothing more), so its
        daemon is gone, and its child goes too."""
        try:
            data = conn.recv(1)
        except OSError:
            data = b""
        if data:
            return
        for pid, c in list(self.children.items()):
            if c is conn:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.sel.unregister(conn)

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            try:
                _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
            except OSError:
                pass
            try:
                self.sel.unregister(conn)
            except (KeyError, ValueError):
                pass
            conn.close()


def _run(argv: list[str]) -> int:
    """What `python argv...` would run: `-m module args` or `-c code args`."""
    import runpy

    if len(argv) < 2 or argv[0] not in ("-m", "-c"):
        raise ValueError(f"argv must start with -m MODULE or -c CODE, got {argv[:2]}")
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    return 0


def _refuse(conn: socket.socket, fds: list[int], why: str) -> None:
    """Answer a request that gets no child with why, and let go of what it sent."""
    for fd in fds:
        os.close(fd)
    try:
        _send(conn, {"error": why})
    except OSError:  # (its client is gone already)
        pass
    conn.close()


def _send(conn: socket.socket, msg: dict) -> None:
    conn.sendall(json.dumps(msg).encode() + b"\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("socket", help="the UNIX socket to listen on")
    ap.add_argument("--parent", type=int, default=None, help="die with this process")
    ap.add_argument("--preload", action="append", default=[],
                    help="a module to import besides the usual (skipped if missing)")
    args = ap.parse_args()
    env = dict(os.environ)
    if args.parent is not None:
        _die_with_parent()
        if os.getppid() != args.parent:
            sys.exit(0)
    for name in (*PRELOAD, *args.preload):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        sys.exit("zygote: CUDA started during the imports; a fork could not use it")
    try:
        zygote = Zygote(args.socket, env)
    except FileNotFoundError:
        # A parent's zygote whose folder went during the imports: the parent is ending (a
        # short test run removes the folder at exit, before the signal of its death comes).
        # Nobody is left to serve. (One an operator started says what is wrong.)
        if args.parent is not None:
            sys.exit(0)
        sys.exit(f"zygote: cannot listen at {args.socket}: its folder does not exist")
    zygote.serve()


if __name__ == "__main__":
    main()
