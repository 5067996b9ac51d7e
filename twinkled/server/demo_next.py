"""After `make demo`: the tiny demo model kept, `make serve`, and the next commands to type.

`make demo` stops its daemon when the two tenants are done; what a newcomer does next is
serve the same model and point their own client at it. `make serve` runs `python -m
twinkled.server.demo_next`: it builds the tiny model once (offline) and serves it in the
foreground on a data dir that persists, outside the working tree. The demo ends with
`next_steps()`: the exact commands, one a line, until a blank line (the README shows the
same block, and tests/test_newcomer.py runs it).

Defaults, each an environment variable (never the working directory):
  TWINKLE_PORT       the port (8000)
  TWINKLE_DEMO_DATA  the data dir ($XDG_STATE_HOME/twinkle-demo, ~/.local/state/twinkle-demo)
  TWINKLE_CACHE      where the tiny model is built (~/.cache/twinkle, as the cookbook's)
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

MODEL_NAME = "demo-tiny-qwen3"


def port() -> int:
    return int(os.environ.get("TWINKLE_PORT") or 8000)


def data_dir() -> Path:
    if os.environ.get("TWINKLE_DEMO_DATA"):
        return Path(os.environ["TWINKLE_DEMO_DATA"]).expanduser()
    state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return state / "twinkle-demo"


def model_dir() -> Path:
    """The demo's tiny random-weight model, built once (about a second, offline)."""
    from twinkled.engine.tiny import build_tiny_model

    root = Path(os.environ.get("TWINKLE_CACHE") or Path.home() / ".cache" / "twinkle")
    out = root / MODEL_NAME
    if not (out / "config.json").is_file():
        build_tiny_model(out)
    return out


def _shown(path: Path) -> str:
    """A path as a person would type it: ~ for the home directory."""
    home = str(Path.home())
    text = str(path)
    if text == home or text.startswith(home + os.sep):
        return "~" + text[len(home):]
    return shlex.quote(text)


def in_project_venv() -> bool:
    """Whether `make` installed into the project's .venv (then `twinkled` is on PATH only
    once it is activated)."""
    root = Path(__file__).resolve().parents[2]  # the checkout: twinkled/server/ is two down
    return Path(sys.prefix).resolve() == (root / ".venv").resolve()


def next_steps() -> str:
    url = f"http://127.0.0.1:{port()}"
    lines = ["", "Keep playing: serve the same tiny model, make a key, point a client at it:"]
    if in_project_venv():
        lines.append("source .venv/bin/activate    # make installed into .venv: puts "
                     "`twinkled` on PATH")
    lines += [
        f"make serve &                 # {MODEL_NAME} at {url}, data in "
        f"{_shown(data_dir())} (TWINKLE_PORT, TWINKLE_DEMO_DATA)",
        f"until curl -sf {url}/api/v1/healthz | grep -q '\"ok\"'; do sleep 1; done"
        "   # until it serves",
        f"KEY=$(twinkled ctl --data-dir {_shown(data_dir())} keys create --tenant me "
        "| tail -1)",
        f"python examples/tinker_tenant.py --base-url {url} --api-key \"$KEY\" "
        f"--base-model {MODEL_NAME} --name me --steps 20",
        f"curl -s {url}/oai/api/v1/completions -H \"Authorization: Bearer $KEY\" "
        f"-H 'Content-Type: application/json' -d '{{\"model\": \"{MODEL_NAME}\", "
        "\"prompt\": \"the sun\", \"max_tokens\": 8}'",
        "",
        f"Tinker:  tinker.ServiceClient(base_url=\"{url}\", api_key=KEY)",
        f"OpenAI:  OpenAI(base_url=\"{url}/oai/api/v1\", api_key=KEY)",
        "Stop the daemon with `kill %1` (it drains and persists); its runs, checkpoints and "
        "keys stay in the data dir for the next `make serve`.",
    ]
    return "\n".join(lines)


def main() -> None:
    """`make serve`: the tiny demo model in the foreground, on the persistent data dir."""
    model = model_dir()
    data = data_dir()
    print(f"serving {model} as {MODEL_NAME} on port {port()}, data dir {data}", flush=True)
    argv = [sys.executable, "-m", "twinkled", "serve", "--model", str(model), "--data-dir",
            str(data), "--port", str(port()), "--device", "cpu", "--dtype", "float32"]
    os.execv(sys.executable, argv)  # the daemon itself gets Ctrl+C and SIGTERM


if __name__ == "__main__":
    main()
