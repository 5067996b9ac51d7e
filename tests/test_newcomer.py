"""A newcomer's first hour, as the README writes it (issue 30): in a fresh clone, run the
README's commands in order, as written: `make demo` and `make test`, then the commands the
demo prints at its end (the README's "After the demo" block, which must be what the demo
prints), then the five commands of "Your model on your GPU" on a tiny model.

Offline and cheap: nothing is downloaded or built but the clone's own editable install.
The clone gets a virtual environment of its own that sees the packages already installed
(the interpreter's and, through a .pth file, this one's), so `make` finds everything
satisfied and installs only the clone; the environment running this test is not touched.
Only what a reader could not run here is changed, each named below: the port (a free one),
the home directory (a temporary one), `/models/` (a tiny random-weight model saved there),
`source .venv/bin/activate` (a virtual environment is already active, as the line says),
the tinker SDKs' cache (this machine's, which `make install` filled),
`make test` runs one cheap test file in the test process itself (the suite is CI's own
step; collecting it all costs ~15 s of CPU), and the README's own tenants train STEPS
steps, not 20 (`--steps 20`): nothing here asserts a training curve, only that each command
ran (the demo's tenants train their 60: `make demo` takes no option).

The clone is of the committed HEAD: commit before running this test.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import site
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tinker_sdks

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
STEPS = 3  # steps each tenant trains (see the module's docstring)
pytestmark = pytest.mark.skipif(shutil.which("git") is None or shutil.which("make") is None
                                or shutil.which("curl") is None,
                                reason="needs git, make and curl")


def bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README, flags=re.S)


def block_with(first: str) -> str:
    """The one block with a line that starts with `first`."""
    found = [b for b in bash_blocks() if any(ln.startswith(first) for ln in b.splitlines())]
    assert len(found) == 1, f"one README block with a line {first!r}..., found {len(found)}"
    return found[0]


def commands(block: str) -> list[str]:
    """A block's command lines, without the activation line (see the module's docstring)."""
    return [ln for ln in block.strip().splitlines()
            if ln.strip() and not ln.startswith("source .venv/bin/activate")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Newcomer:
    """A fresh clone, its own environment, and a shell that runs README blocks in it."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.clone = tmp / "clone"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(self.clone)], check=True,
                       timeout=120)
        venv = tmp / "venv"
        base = Path(sys.base_prefix) / "bin" / "python3"
        subprocess.run([str(base), "-m", "venv", "--without-pip", "--system-site-packages",
                        str(venv)], check=True, timeout=120)
        if sys.prefix != sys.base_prefix:  # this test's own venv: its packages, not its code
            own = [p for p in site.getsitepackages() if p.startswith(sys.prefix)]
            version = f"python{sys.version_info.major}.{sys.version_info.minor}"
            (venv / "lib" / version / "site-packages" / "newcomer.pth").write_text(
                "\n".join(own) + "\n")
        self.port = _free_port()
        drop = ("PYTHON", "PYTHONPATH", "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "XDG_STATE_HOME",
                "XDG_DATA_HOME", "XDG_CACHE_HOME", "TWINKLE_CACHE", "TWINKLE_DEMO_DATA",
                "TINKER_BASE_URL", "TINKER_API_KEY", "PYTEST_ADDOPTS", "INSTALL_FORCE")
        self.env = {k: v for k, v in os.environ.items() if k not in drop}
        self.env.update(
            HOME=str(tmp / "home"), HF_HOME=str(tmp / "hf"), HF_HUB_OFFLINE="1",
            TINKER_TELEMETRY="0", VIRTUAL_ENV=str(venv),
            PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
            PIP_NO_INDEX="1", PIP_NO_BUILD_ISOLATION="0",  # offline: all is installed
            TWINKLE_PORT=str(self.port),
            TESTS="tests/test_docs.py", TEST_WORKERS="0",  # `make test`: see above
            # The tinker SDKs `make install` caches: where this machine has them (offline,
            # each make would try and fail to fetch all seven into the temporary home).
            TWINKLE_TINKER_SDKS=str(tinker_sdks.cache_dir()))
        (tmp / "home").mkdir()

    def script(self, lines: list[str]) -> str:
        text = "\n".join(lines).replace("127.0.0.1:8000", f"127.0.0.1:{self.port}")
        text = text.replace("--port 8000", f"--port {self.port}")
        return text.replace("/models/", f"{self.tmp}/models/")

    def run(self, lines: list[str], timeout: float = 900) -> str:
        """The lines as one bash script in the clone; whatever it left running (a daemon
        started with `&`) is stopped afterwards, as `kill %1` would."""
        # Output to a file, not a pipe: a daemon left running holds its end open.
        log = self.tmp / f"block-{len(list(self.tmp.glob('block-*')))}.log"
        with open(log, "w") as sink:
            text = self.script(lines).replace(" --steps 20", f" --steps {STEPS}")
            proc = subprocess.Popen(["bash", "-c", "set -euo pipefail\n" + text],
                                    cwd=self.clone, env=self.env, stdout=sink,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                proc.wait(timeout=timeout)
            finally:
                self._stop_group(proc.pid)
        out = log.read_text()
        assert proc.returncode == 0, f"exit {proc.returncode}:\n{out[-6000:]}"
        return out

    @staticmethod
    def _stop_group(pgid: int) -> None:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.time() + 90  # the daemon drains and persists
        while time.time() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.5)
        os.killpg(pgid, signal.SIGKILL)


def test_the_readme_runs_as_written_in_a_fresh_clone(tmp_path):
    me = Newcomer(tmp_path)
    top = commands(bash_blocks()[0])
    assert [ln.split("#")[0].strip() for ln in top] == ["make demo", "make test"]
    out = me.run(top)
    assert "[alice] asked 'who are you?'" in out and "[bob] asked 'who are you?'" in out
    assert re.search(r"\d+ passed", out), out[-3000:]
    # `make demo` installed the clone; `make test` found it all there and ran no pip.
    assert out.count("install.sh: done") == 1 and "nothing to do" in out, out[-3000:]

    # The demo ends with the next commands; the README shows the same ones.
    printed = out.split("Keep playing:", 1)[1].split("\n", 1)[1].split("\n\n", 1)[0]
    after = block_with("make serve &")
    assert commands(printed) == [me.script([ln]) for ln in commands(after)]
    assert f'base_url="http://127.0.0.1:{me.port}"' in out
    assert f'base_url="http://127.0.0.1:{me.port}/oai/api/v1"' in out
    played = me.run(commands(after))
    assert "[me] asked 'who are you?'" in played
    assert "FutureWarning" not in played  # the example uses tinker 0.38 as it asks
    assert '"choices"' in played  # the OpenAI-style completion answered
    # The demo's data dir persists outside the working tree, and nothing was written there.
    assert (tmp_path / "home" / ".local" / "state" / "twinkle-demo" / "twinkle.db").is_file()

    # Your model on your GPU: five commands, on a tiny model saved where the README's is.
    gpu = commands(block_with("make install "))
    assert len(gpu) == 4  # + the activation line: five
    from twinkled.engine.tiny import build_tiny_model

    build_tiny_model(tmp_path / "models" / "Qwen3-8B")
    mine = me.run(gpu)
    assert "[tenant] asked 'who are you?'" in mine
    status = subprocess.run(["git", "status", "--porcelain", "--ignored"], cwd=me.clone,
                            capture_output=True, text=True, check=True).stdout
    written = [ln for ln in status.splitlines()
               if not re.search(r"(__pycache__|\.egg-info|\.pytest_cache)/?$", ln)]
    assert written == [], "the commands wrote into the working tree"
