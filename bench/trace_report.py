"""Where the daemon's steps spend their time, from a TWINKLED_TRACE file (twinkled/protocol/trace.py).

    python bench/trace_report.py trace.jsonl [--last 40]

For the last `--last` steps (the timed window of a bench), in milliseconds (median / p90):
the loop's phases (plan, execute, complete), the gap to the next step and the wait for
clients in it; inside execute, each rank's delivery (frame sent -> rank began), busy time
and return (rank done -> reply arrived), and the skew (slowest rank's finish minus the
fastest's).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def q(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))] if xs else float("nan")


def steps(path: Path) -> list[dict]:
    """Each loop event with the group event (the last transport run) inside it and the
    gather wait before it, matched within its lane (twinkled --lanes: one loop per lane)."""
    out, group, gather = [], {}, {}
    for line in path.read_text().splitlines():
        e = json.loads(line)
        lane = e.get("lane", 0)
        if e["event"] == "group":
            group[lane] = e
        elif e["event"] == "gather":
            gather[lane] = e["waited"]
        elif e["event"] == "loop":
            out.append({**e, "lane": lane, "group": group.pop(lane, None),
                        "gather": gather.pop(lane, 0.0)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--last", type=int, default=40)
    args = ap.parse_args()
    all_steps = steps(args.trace)
    window = all_steps[-args.last:]
    rows: dict[str, list[float]] = {}

    def add(name: str, v: float) -> None:
        rows.setdefault(name, []).append(1e3 * v)

    for lane in sorted({s["lane"] for s in window}):
        mine = [s for s in window if s["lane"] == lane]
        for prev, s in zip(mine, mine[1:], strict=False):
            add("gap: previous step done -> plan", s["planned"] - prev["done"])
    for s in window:
        # A barrier step says what it held (optim_steps that missed their rows' step, or
        # create / save / unload); a train step, whether optim_steps rode behind its rows.
        what = "+".join(s.get("work", []))
        add(f"step ({s['kind']}: {what})" if what else f"step ({s['kind']})",
            s["done"] - s["planned"])
        add("  queued (oldest op)", s["queued"])
        add("  gather wait before", s["gather"])
        add("  plan", s["executing"] - s["planned"])
        add("  execute", s["completing"] - s["executing"])
        add("  complete", s["done"] - s["completing"])
        g = s["group"]
        if g is None:
            continue
        ends = [r["began"] + r["busy"] for r in g["ranks"]]
        add("    executor before send", g["sent"] - s["executing"])
        for i, r in enumerate(g["ranks"]):
            add(f"    rank {i} delivery", r["began"] - g["sent"])
            add(f"    rank {i} busy", r["busy"])
            for phase, v in r.get("phases", {}).items():
                if not phase.endswith(("steps", "rows")):  # (counts: the sampler's, below)
                    add(f"      rank {i} {phase}", v)
            add(f"    rank {i} return", r["arrived"] - r["began"] - r["busy"])
        add("    skew (slowest - fastest finish)", max(ends) - min(ends))
        add("    executor after last reply", s["completing"] - max(r["arrived"] for r in g["ranks"]))
    span = window[-1]["done"] - window[0]["planned"] if window else 0.0
    print(f"{len(window)} steps of {len(all_steps)} over {span:.2f} s "
          f"({len(window) / span if span else 0:.1f} steps/s)")
    print(f"{'phase':44s} {'n':>4s} {'median ms':>10s} {'p90 ms':>8s} {'total s':>8s}")
    for name, xs in rows.items():
        print(f"{name:44s} {len(xs):4d} {statistics.median(xs):10.2f} {q(xs, 0.9):8.2f} "
              f"{sum(xs) / 1e3:8.2f}")


if __name__ == "__main__":
    main()
