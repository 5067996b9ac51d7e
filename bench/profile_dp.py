"""Data parallelism inside the engine, without the daemon: where a rank's round goes.

Run with torchrun, one process per GPU. Every rank holds all `--adapters` adapters (as the
worker group's ranks do) and runs its share of the rows (one row of `--seq` tokens per
adapter, split evenly), then the optimizer steps of every adapter, whose gradients are
summed over the ranks first. Prints each phase's median time per rank, and the same round
on one rank alone with the same per-rank rows, for comparison.

    torchrun --nproc_per_node 2 bench/profile_dp.py --adapters 16
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from bench_engine import build_model
from profile_engine import tenant_rows

from twinkled.engine.engine import Engine
from twinkled.protocol.types import AdamParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    model_dir = Path(tempfile.gettempdir()) / f"profile_dp_{args.shape}"
    if rank == 0 and not (model_dir / "config.json").exists():
        build_model(args.shape, model_dir, torch.bfloat16, "cuda:0")
    dist.barrier()
    eng = Engine(model_dir, dtype=torch.bfloat16, device=dev, dp_group=dist.group.WORLD)
    names, reqs = tenant_rows(eng, args.adapters, args.seq)
    mine = reqs[rank::world]
    adam = [(n, AdamParams(learning_rate=1e-4)) for n in names]
    phases: dict[str, list[float]] = {"forward_backward": [], "optim (reduce + step)": []}
    for i in range(args.rounds + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.forward_backward(mine)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        eng.optim_steps(adam)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= 2:
            phases["forward_backward"].append(t1 - t0)
            phases["optim (reduce + step)"].append(t2 - t1)
    med = {k: statistics.median(v) for k, v in phases.items()}
    total = sum(med.values())
    tokens = args.seq * len(reqs)
    line = " ".join(f"{k} {v * 1e3:.1f} ms" for k, v in med.items())
    print(f"rank {rank}/{world} ({os.uname().nodename}): {line}; round {total * 1e3:.1f} ms, "
          f"group {tokens / total:,.0f} tok/s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
