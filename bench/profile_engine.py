"""Where a co-batched training round spends its time: forward/backward vs optimizer, and the
top operators by host and device time (torch.profiler). A tool for tuning, not a benchmark.

    python bench/profile_engine.py --shape qwen2.5-0.5b --device cuda
    python bench/profile_engine.py --shape qwen3-8b --adapters 1 --adapters 8 --model-dir /tmp/m

Per run: wall times, the host's issuing time against its wait for the device (step.py's
HOST_TIME: issuing near the whole means launch-bound), the device syncs of a round
(set_sync_debug_mode), and the profiled round's GPU busy time, kernels and aten ops.
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
from twinkled.engine.step import HOST_TIME  # noqa: E402
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


def gpu_figures(prof) -> tuple[float, int, int]:
    """(device ms, kernels, host aten ops) of a profiled region."""
    from torch.autograd import DeviceType

    events = prof.events()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    ops = sum(1 for e in events if e.device_type == DeviceType.CPU and e.name.startswith("aten::"))
    return sum(e.time_range.elapsed_us() for e in kernels) / 1e3, len(kernels), ops


def host_syncs(fn) -> list[str]:
    """The device syncs `fn` makes (torch.cuda.set_sync_debug_mode), one line each."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return [str(w.message).splitlines()[0][:120] for w in caught]


def run(eng: Engine, adapters: int, seq: int, dev: torch.device, tables: bool) -> None:
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    names, reqs = tenant_rows(eng, adapters, seq)

    def fb():
        return eng.forward_backward(reqs)

    def opt():
        eng.optim_steps([(n, AdamParams(learning_rate=1e-4)) for n in names])

    fb_t, opt_t, host = [], [], []
    loss = None
    for i in range(7):
        sync()
        t0 = time.perf_counter()
        out = fb()
        sync()
        t1 = time.perf_counter()
        opt()
        sync()
        t2 = time.perf_counter()
        taken = HOST_TIME.take()
        loss = loss if loss is not None else out[0].metrics["loss:sum"]
        if i >= 2:
            fb_t.append(t1 - t0)
            opt_t.append(t2 - t1)
            host.append(taken)
    fbm, om = statistics.median(fb_t), statistics.median(opt_t)
    tokens = seq * adapters
    issue = statistics.median(h["forward"] + h["backward"] for h in host)
    wait = statistics.median(h["device wait"] for h in host)
    print(f"== {adapters} adapter(s) x {seq}: first loss:sum {loss:.4f}")
    print(f"forward_backward {fbm * 1e3:.1f} ms (host issuing {issue * 1e3:.1f} ms, then "
          f"waiting {wait * 1e3:.1f} ms), optimizer steps {om * 1e3:.1f} ms, round "
          f"{(fbm + om) * 1e3:.1f} ms, {tokens / (fbm + om):,.0f} tok/s")
    if dev.type == "cuda":
        syncs = host_syncs(lambda: (fb(), opt(), sync()))
        print(f"device syncs in a round: {len(syncs)}", *sorted(set(syncs))[:4], sep="\n  ")
    acts = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        fb()
        opt()
        sync()
        profiled = time.perf_counter() - t0
    if dev.type == "cuda":
        gpu_ms, n_kernels, n_ops = gpu_figures(prof)
        print(f"profiled round: {profiled * 1e3:.1f} ms wall, GPU busy {gpu_ms:.1f} ms in "
              f"{n_kernels} kernels, {n_ops} aten ops")
    if tables:
        key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=25))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    for n in names:
        eng.remove_adapter(n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--adapters", type=int, action="append",
                    help="adapters, one row each; repeatable (one model load; default 8)")
    ap.add_argument("--model-dir", type=Path,
                    help="the checkpoint to load, written there first if missing (several "
                         "runs, e.g. of two versions of the code, then share one)")
    ap.add_argument("--no-tables", action="store_true", help="figures only")
    ap.add_argument("--after", type=Path, help="measure once this file exists (two versions "
                    "of the code load side by side, then take turns on the device)")
    ap.add_argument("--done", type=Path, help="a file to write when done")
    ap.add_argument("--fused", default="all", help="all, none, or levers: norm,rope,silu,gemm,prep")
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or Path(tmp) / "model"
        if not (model_dir / "config.json").exists():
            build_model(args.shape, model_dir, dtype, dev.type)
        eng = Engine(model_dir, dtype=dtype, device=dev)
        eng.model.fused = Fused.parse(args.fused)
        while args.after is not None and not args.after.exists():
            time.sleep(0.2)
        for adapters in args.adapters or [8]:
            run(eng, adapters, args.seq, dev, not args.no_tables)
        if args.done is not None:
            args.done.touch()


if __name__ == "__main__":
    main()
