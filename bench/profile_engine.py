"""Where a co-batched training round spends its time: forward/backward vs optimizer, and the
top operators by host and device time (torch.profiler). A tool for tuning, not a benchmark.

    python bench/profile_engine.py --shape qwen2.5-0.5b --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import build_model  # noqa: E402

from twinkled.engine.engine import Engine  # noqa: E402
from twinkled.engine.fused_ops import Fused  # noqa: E402
from twinkled.protocol.types import AdamParams, Datum, ForwardBackwardRequest, LoraConfig


def tenant_rows(eng: Engine, adapters: int, seq: int
                ) -> tuple[list[str], list[ForwardBackwardRequest]]:
    """`adapters` adapters (r=32, seeded) and one random row of `seq` tokens for each."""
    names = [f"t{i}" for i in range(adapters)]
    for i, n in enumerate(names):
        eng.add_adapter(n, LoraConfig(rank=32, alpha=32, seed=i, train_unembed=False))
    gen = torch.Generator().manual_seed(0)
    reqs = []
    for n in names:
        ids = torch.randint(0, eng.model.vocab_size, (seq + 1,), generator=gen)
        reqs.append(ForwardBackwardRequest(n, [Datum(ids[:-1], {"target_tokens": ids[1:]})]))
    return names, reqs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--fused", default="all", help="all, none, or levers: norm,rope,silu,gemm")
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        build_model(args.shape, model_dir, dtype, dev.type)
        eng = Engine(model_dir, dtype=dtype, device=dev)
        eng.model.fused = Fused.parse(args.fused)
        names, reqs = tenant_rows(eng, args.adapters, args.seq)

        def fb():
            eng.forward_backward(reqs)

        def opt():
            eng.optim_steps([(n, AdamParams(learning_rate=1e-4)) for n in names])

        fb_t, opt_t = [], []
        for i in range(7):
            sync()
            t0 = time.perf_counter()
            fb()
            sync()
            t1 = time.perf_counter()
            opt()
            sync()
            t2 = time.perf_counter()
            if i >= 2:
                fb_t.append(t1 - t0)
                opt_t.append(t2 - t1)
        fbm, om = statistics.median(fb_t), statistics.median(opt_t)
        tokens = args.seq * args.adapters
        print(f"forward_backward {fbm * 1e3:.1f} ms, optimizer steps {om * 1e3:.1f} ms, "
              f"round {tokens / (fbm + om):,.0f} tok/s")
        acts = [torch.profiler.ProfilerActivity.CPU]
        if dev.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=acts) as prof:
            fb()
            opt()
            sync()
        key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=25))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
