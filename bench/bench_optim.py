"""Host time of the optimizer step and the gradient all-reduce for many adapters at once.

The part of a data-parallel round that grows with the adapters stepping (issue 14): per
adapter, one tensor per kind of state (LoRA banks held slot-major) against two per module
before. Tiny module shapes keep the arithmetic negligible, so what is timed is the host
work. `--against DIR` runs the same in another checkout (e.g. `.base`, an older commit)
in the same run, for the ratio.

    python bench/bench_optim.py [--adapters 15] [--against .base]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from output import emit, section_path  # noqa: E402

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def measure(adapters: int, layers: int, repeats: int) -> dict[str, float]:
    """Median ms of `optimizer_steps` and `reduce_gradients` (gloo, one rank) for the code
    on sys.path."""
    import torch.distributed as dist

    from twinkled.engine.lora import LoraPool
    from twinkled.engine.optim import optimizer_steps
    from twinkled.engine.parallel import reduce_gradients
    from twinkled.protocol.types import AdamParams, LoraConfig

    targets = {f"model.layers.{i}.mlp.{m}": (8, 8) for i in range(layers) for m in MODULES}
    pool = LoraPool(targets, 4, "cpu")
    ads = [pool.add(f"a{i}", LoraConfig(rank=2, alpha=2, seed=i)) for i in range(adapters)]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    adam = AdamParams(learning_rate=1e-4)
    out = {}
    for name, run in (("optimizer step", lambda: optimizer_steps([(a, adam) for a in ads])),
                      ("gradient all-reduce", lambda: reduce_gradients(ads, None))):
        times = []
        for _ in range(repeats + 1):  # the first fills caches
            for a in ads:
                a.pending = 1
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
        out[name] = 1e3 * statistics.median(times[1:])
    dist.destroy_process_group()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapters", type=int, default=15)
    ap.add_argument("--layers", type=int, default=24, help="7 LoRA modules each (0.5B: 24)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--against", type=Path, help="another checkout to time in the same run")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--write", default=section_path("optim"))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.adapters, args.layers, args.repeats)))
        return

    def run(root: Path) -> dict[str, float]:
        env = dict(os.environ, PYTHONPATH=str(root.resolve()))
        cmd = [sys.executable, __file__, "--child", "--adapters", str(args.adapters),
               "--layers", str(args.layers), "--repeats", str(args.repeats)]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        return json.loads(res.stdout.strip().splitlines()[-1])

    ours = run(HERE.parent)
    theirs = run(args.against) if args.against else None
    text = (f"## Optimizer host time, {args.adapters} adapters x {7 * args.layers} LoRA "
            f"modules (CPU, tiny shapes)\n\n- command: `python bench/bench_optim.py "
            f"{' '.join(sys.argv[1:])}`\n\n| phase | this checkout (ms) |"
            + (f" {args.against} (ms) | ratio |\n|---|---:|---:|---:|\n" if theirs else
               "\n|---|---:|\n"))
    for phase, ms in ours.items():
        text += f"| {phase} | {ms:.2f} |"
        text += f" {theirs[phase]:.2f} | {theirs[phase] / ms:.1f}x |\n" if theirs else "\n"
    emit(text, args.write)


if __name__ == "__main__":
    main()
