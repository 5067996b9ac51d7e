"""What serving each GPU's tenants on their own would give: N daemons, one per GPU.

The bound for placing each tenant's adapter on one GPU (no gradient sums, no lock-step
between GPUs, each GPU's step gathered from its own tenants) against the data-parallel
worker group of `bench_workers.py`, where every rank holds every adapter. In one run: one
daemon on the first device with `--tenants` tinker tenants, then one daemon per device,
all at once, each with as many tenants. The N daemons share the host (CPU, PCIe), as lanes
in one daemon would.

    python bench/bench_lanes.py --devices cuda:0-3 --shape qwen2.5-0.5b
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_multitenant import make_keys, pct, run_tenants, start_daemon  # noqa: E402
from output import emit, section_path  # noqa: E402


def run_lanes(devices: list[str], model_dir: Path, work: Path, vocab: int, seq: int,
              steps: int, tenants: int, extra: tuple[str, ...]) -> tuple[float, list[float]]:
    """One daemon per device, `tenants` tinker tenants each, all at once: (tok/s, latencies)."""
    def up(i: int, dev: str):  # the lanes start side by side: each loads its model
        lane = work / f"n{len(devices)}-lane{i}"
        lane.mkdir()
        keys = make_keys(lane / "data", tenants)
        daemon, url, log = start_daemon(model_dir, lane / "data", lane, dev, *extra,
                                        port=19000 + 10 * len(devices) + i)
        return daemon, log, url, keys

    with ThreadPoolExecutor(len(devices)) as pool:
        daemons = list(pool.map(up, range(len(devices)), devices))
        try:
            runs = list(pool.map(lambda d: run_tenants(d[2], d[3], model_dir.name, vocab, seq,
                                                       steps, [1] * tenants), daemons))
        finally:
            for daemon, log, _, _ in daemons:
                daemon.terminate()
                daemon.wait(timeout=120)
                log.close()
    res = [r for run in runs for r in run]
    wall = max(r["t1"] for r in res) - min(r["t0"] for r in res)
    return sum(r["tokens"] for r in res) / wall, [x for r in res for x in r["lat"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", required=True, help="e.g. cuda:0-3")
    ap.add_argument("--shape", default="tiny", choices=("tiny", "qwen2.5-0.5b", "qwen3-8b"))
    ap.add_argument("--tenants", type=int, default=8, help="tenants per device")
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--config", default=None, help="a twinkled TOML config for the daemons")
    ap.add_argument("--write", default=section_path("lanes"))
    args = ap.parse_args()

    from bench_engine import header
    from bench_workers import prepare

    from twinkled.server.layout import expand_devices

    devices = expand_devices(args.devices)
    gpu, dtype, seq, steps, work, model_dir, vocab = prepare(args, devices, "bench_lanes_")
    extra = ("--config", args.config) if args.config else ()
    rows = []
    for group in (devices[:1], devices):
        tps, lat = run_lanes(group, model_dir, work, vocab, seq, steps, args.tenants, extra)
        rows.append((len(group), tps, pct(lat, 0.5), pct(lat, 0.99)))
    text = header("cuda" if gpu else "cpu").replace("Engine vs peft", "One daemon per device")
    text += (f"\n### {args.shape} ({','.join(devices)}, {str(dtype).split('.')[-1]}, LoRA r=32, "
             f"S={seq}, {args.tenants} tinker tenants per device at 1 x S each, {steps} timed "
             "steps)\n\n| daemons | tenants | tokens/s | vs 1 | step p50 (s) | step p99 (s) |\n"
             "|---:|---:|---:|---:|---:|---:|\n")
    for n, tps, p50, p99 in rows:
        text += (f"| {n} | {n * args.tenants} | {tps:,.0f} | {tps / rows[0][1]:.2f}x | "
                 f"{p50:.3f} | {p99:.3f} |\n")
    emit(text, args.write)


if __name__ == "__main__":
    main()
