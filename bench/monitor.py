"""Who is busy while a bench runs: CPU% of the daemon, its workers and the tenants, and GPU
utilisation, sampled every few seconds (Linux /proc and nvidia-smi; no dependencies).

    python bench/monitor.py --every 5 --for 300 &   # beside a bench

A worker near 100% CPU with its GPU well under 100% is host-bound (Python and kernel
launches); a daemon near 100% bounds every worker at once.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def processes() -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds) of the processes of interest."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if "twinkled.workers.worker" in cmd:
            role = "worker " + cmd.split('"device": "')[1].split('"')[0] if '"device"' in cmd \
                else "worker"
        elif "twinkled serve" in cmd or "-m twinkled serve" in cmd:
            role = "daemon"
        elif "--worker" in cmd and "bench_" in cmd:
            role = "tenants"
        else:
            continue
        out[int(d.name)] = (role, (int(stat[11]) + int(stat[12])) / TICK)
    return out


def gpus() -> str:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=index,utilization.gpu",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True,
                           timeout=10)
        return " ".join(f"gpu{line.split(',')[0].strip()}={line.split(',')[1].strip()}%"
                        for line in r.stdout.strip().splitlines())
    except (OSError, subprocess.SubprocessError, IndexError):
        return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--every", type=float, default=5.0)
    ap.add_argument("--for", dest="duration", type=float, default=300.0)
    args = ap.parse_args()
    end = time.time() + args.duration
    last, t_last = processes(), time.time()
    while time.time() < end:
        time.sleep(args.every)
        now, t_now = processes(), time.time()
        load: dict[str, float] = {}
        for pid, (role, cpu) in now.items():
            if pid in last:
                load[role] = load.get(role, 0.0) + (cpu - last[pid][1]) / (t_now - t_last)
        if load:
            busy = " ".join(f"{role}={100 * v:.0f}%" for role, v in sorted(load.items()))
            print(f"{time.strftime('%H:%M:%S')} {busy} {gpus()}", flush=True)
        last, t_last = now, t_now


if __name__ == "__main__":
    main()
