"""Where the daemon's main process spends its time per request (the host path).

Starts `twinkled serve` under cProfile on the tiny model (or a shape on a GPU), drives it
with N tinker tenants (1 x S each, forward_backward + optim_step per round), stops it, and
prints the main process's CPU time per tenant round and its most expensive functions. The
main process is serial: its time per round bounds the rounds per second of the whole
daemon, whatever the number of GPUs.

    python bench/profile_daemon.py --tenants 8 --steps 20
"""

from __future__ import annotations

import argparse
import io
import os
import pstats
import tempfile
import time
from pathlib import Path

from bench_engine import build_model
from bench_multitenant import make_keys, run_tenants, start_daemon
from output import emit, section_path


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--write", default=section_path("profile_daemon"))
    args = ap.parse_args()

    import torch

    gpu = args.device.startswith("cuda")
    work = Path(tempfile.mkdtemp(prefix="profile_daemon_"))
    vocab = build_model(args.shape, work / "model", torch.bfloat16 if gpu else torch.float32,
                        args.device)
    data = work / "data"
    keys = make_keys(data, args.tenants)
    prof = work / "daemon.prof"
    daemon, url, log = start_daemon(work / "model", data, work, args.device,
                                    launcher=("-m", "cProfile", "-o", str(prof)))
    cpu0, t0 = cpu_seconds(daemon.pid), time.time()
    res = run_tenants(url, keys, "model", vocab, args.seq, args.steps, [1] * args.tenants)
    cpu1, t1 = cpu_seconds(daemon.pid), time.time()
    daemon.terminate()
    daemon.wait(timeout=120)
    log.close()
    # Every tenant's warm-up and set-up ran in the window too; count its rounds as well.
    rounds = args.tenants * (args.steps + 2)
    wall = max(r["t1"] for r in res) - min(r["t0"] for r in res)
    timed_rounds = args.tenants * args.steps
    text = (f"### main process, {args.tenants} tenants x 1 x {args.seq}, {args.shape} on "
            f"{args.device}\n\n"
            f"- main-process CPU: {cpu1 - cpu0:.2f} s over {t1 - t0:.1f} s wall, "
            f"{1e3 * (cpu1 - cpu0) / rounds:.2f} ms per round (forward_backward + optim_step "
            f"+ polls, set-up included)\n"
            f"- timed rounds: {timed_rounds / wall:.1f} rounds/s\n\n```\n")
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(str(prof), stream=out).sort_stats(key).print_stats(args.top)
        body = out.getvalue()
        text += body[body.index("   ncalls"):] + "\n"
    text += "```\n"
    emit(text, args.write)


if __name__ == "__main__":
    main()
