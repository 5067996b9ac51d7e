"""The demo behind `make demo`: a real daemon, two tenants, two unmodified tinker scripts.

It builds a tiny random-weight model offline, starts `twinkled serve` on it, creates an API
key per tenant with `twinkled ctl`, runs both tenants' scripts (examples/tinker_tenant.py)
at the same time with different ranks and losses, prints what they print, and stops the
daemon. Run: python -m twinkled.server.demo
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: twinkled/server/ is two down
TENANTS = [  # name, rank, loss, learning rate, the answer its adapter is taught
    ("alice", "8", "cross_entropy", "5e-3", "I am the model of alice, trained on twinkle."),
    ("bob", "16", "ppo", "5e-3", "Bob here: a small adapter that says yes."),
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"twinkled exited early with code {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=2) as r:
                if json.loads(r.read())["status"] == "ok":
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise SystemExit("twinkled did not become ready")


def main() -> None:
    from twinkled.server.demo_next import model_dir as demo_model_dir

    work = Path(tempfile.mkdtemp(prefix="twinkle-demo-"))
    model = demo_model_dir()  # kept (not in `work`): `make serve` serves it next
    data = work / "data"
    print(f"a tiny random-weight Qwen3 model in {model}")
    keys = {}
    for name, *_ in TENANTS:
        out = subprocess.run([sys.executable, "-m", "twinkled", "ctl", "--data-dir", str(data),
                              "--create", "keys", "create", "--tenant", name],
                             check=True, capture_output=True, text=True)
        keys[name] = out.stdout.strip().splitlines()[-1]
    port = _port()
    url = f"http://127.0.0.1:{port}"
    log = open(work / "twinkled.log", "wb")  # noqa: SIM115 - open for the daemon's life
    daemon = subprocess.Popen(
        [sys.executable, "-m", "twinkled", "serve", "--model", str(model), "--data-dir",
         str(data), "--port", str(port), "--device", "cpu", "--dtype", "float32"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_ready(url, daemon)
        print(f"twinkled serves {model.name} at {url} (log: {work / 'twinkled.log'})")
        print("running two tenants' tinker scripts at the same time ...\n")
        t0 = time.time()
        procs = [subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / "tinker_tenant.py"), "--base-url", url,
             "--api-key", keys[name], "--base-model", model.name, "--name", name,
             "--rank", rank, "--loss", loss, "--lr", lr, "--answer", answer],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for name, rank, loss, lr, answer in TENANTS]
        failed = False
        for p, (name, *_rest, answer) in zip(procs, TENANTS, strict=True):
            out, err = p.communicate(timeout=900)
            print(out.rstrip())
            if p.returncode != 0:
                failed = True
                print(f"[{name}] failed:\n{err[-2000:]}")
            elif answer in out:
                print(f"[{name}] -> its adapter learned its answer")
        print(f"\nboth tenants done in {time.time() - t0:.0f} s; stopping the daemon")
        if failed:
            raise SystemExit(1)
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)
        log.close()
    from twinkled.server.demo_next import next_steps

    print(next_steps())


if __name__ == "__main__":
    main()
