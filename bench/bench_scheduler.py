"""What planning one step costs: 64 models x 16 queued requests, 8 tenants (pure Python).

Each model has 16 queued forward/backward requests of 512 tokens with an optim_step behind
every 4; the planner packs steps of 16384 tokens. Reports the mean and p99 planning time
per step over the whole drain. No torch, no I/O.

    python bench/bench_scheduler.py [--write BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import itertools
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from output import section_path  # bench/ is the script's directory

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from scheduler import TRAIN, Planner, Work  # noqa: E402


def fill(p: Planner, models: int, per_model: int, tenants: int) -> None:
    ids = itertools.count()
    for m in range(models):
        name, tenant = f"m{m}", f"t{m % tenants}"
        p.open_model(name, tenant)
        seq = 1
        for i in range(per_model):
            p.submit(Work(f"w{next(ids)}", tenant, TRAIN, 512, name, seq, parts=[512]))
            seq += 1
            if (i + 1) % 4 == 0:
                p.submit(Work(f"w{next(ids)}", tenant, "optim", 0, name, seq))
                seq += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", default=section_path("scheduler"))
    args = ap.parse_args()
    times = []
    for _ in range(5):
        p = Planner(token_budget=16384)
        fill(p, 64, 16, 8)
        while True:
            t0 = time.perf_counter()
            step = p.next_step()
            times.append(time.perf_counter() - t0)
            if step is None:
                break
            p.complete(step)
    times.sort()
    mean = sum(times) / len(times)
    p99 = times[int(0.99 * (len(times) - 1))]
    text = (f"\n## Scheduler: planning cost per step, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC\n\n"
            f"- machine: {platform.node()} ({platform.processor() or platform.machine()}), "
            f"Python {platform.python_version()}\n"
            f"- command: `python {' '.join(sys.argv)}`\n\n"
            "| queued | steps planned | mean per step | p99 per step | target |\n"
            "|---|---:|---:|---:|---|\n"
            f"| 64 models x 16 requests, 8 tenants | {len(times)} | {mean * 1e3:.3f} ms | "
            f"{p99 * 1e3:.3f} ms | < 1 ms |\n")
    print(text)
    if args.write:
        with open(args.write, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
