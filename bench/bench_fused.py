"""The fused layer's levers (engine/fused_ops.py), each alone and all together, on one model
load: a training round (forward_backward + optimizer steps) of 1 and of `--adapters`
tenants' rows of `--seq` tokens, the fan-out sampling workload's decode step, and the bf16
logits' largest difference from the reference path (all levers off).

    python bench/bench_fused.py --shape qwen3-8b --levers none,norm,rope,silu,gemm,all
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
from bench_engine import build_model, header  # noqa: E402
from bench_sampling import RANK, run_workload, workloads  # noqa: E402
from output import emit, section_path  # noqa: E402
from profile_engine import tenant_rows  # noqa: E402

from twinkled.engine.engine import Engine  # noqa: E402
from twinkled.engine.fused_ops import Fused  # noqa: E402
from twinkled.engine.running import PAGE_SIZE  # noqa: E402
from twinkled.protocol.types import AdamParams, LoraConfig  # noqa: E402


def train_round(eng: Engine, names: list[str], reqs, iters: int) -> float:
    """Median seconds of forward_backward + optimizer steps, after one warm-up round."""
    times = []
    for i in range(iters + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.forward_backward(reqs)
        eng.optim_steps([(n, AdamParams(learning_rate=1e-4)) for n in names])
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def logits_diff(eng: Engine, levers: Fused) -> float:
    ids = torch.randint(0, eng.model.vocab_size, (2, 128), generator=torch.Generator()
                        .manual_seed(0)).cuda()
    pos = torch.arange(128, device="cuda")[None].expand(2, 128)
    out = []
    with torch.no_grad():
        for f in (Fused.off(), levers):
            eng.model.fused = f
            out.append(eng.model.logits(eng.model.forward(ids, pos)).float())
    return (out[0] - out[1]).abs().max().item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--levers", default="none,norm,rope,silu,gemm,all",
                    help="configurations to time, each 'all', 'none' or levers joined by +")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--new", type=int, default=128, help="new tokens a sample (fan-out)")
    ap.add_argument("--skip-sampling", action="store_true")
    ap.add_argument("--write", default=section_path("fused"))
    args = ap.parse_args()
    args.prompt, args.prompts_fanout, args.samples, args.prompts_wide = 512, 32, 8, 0
    args.repeats, args.page_size, args.kv_gb, args.profile = 1, PAGE_SIZE, None, False
    args.baseline = False
    args.bandwidth_gbs = 4800.0 if "H200" in torch.cuda.get_device_name() else 3350.0
    with tempfile.TemporaryDirectory() as tmp:
        vocab = build_model(args.shape, Path(tmp) / "model", torch.bfloat16, "cuda")
        eng = Engine(Path(tmp) / "model", dtype=torch.bfloat16, device=torch.device("cuda"))
        text = header("cuda").replace("Engine vs peft", "Fused layer kernels")
        text += (f"\n### {args.shape}, liger kernels: {eng.model.kernels}; training rounds of "
                 f"1 and {args.adapters} adapters x {args.seq}, fan-out 32 x 8 of 512 + "
                 f"{args.new}\n\n")
        print(text, flush=True)
        names, reqs = tenant_rows(eng, args.adapters, args.seq)
        lone = [r for r in reqs if r.adapter_id == names[0]]
        fanout = next(iter(workloads(args, vocab).values()))
        for i in range(args.adapters):  # the sampling workload's adapters a0.. (B nonzero)
            eng.add_adapter(f"a{i}", LoraConfig(rank=RANK, alpha=RANK, seed=i,
                                                train_unembed=False))
        for spec in args.levers.split(","):
            levers = Fused.parse(spec.replace("+", ","))
            diff = logits_diff(eng, levers)
            eng.model.fused = levers
            one = train_round(eng, names[:1], lone, args.iters)
            many = train_round(eng, names, reqs, args.iters)
            line = (f"{spec:>10}: train 1x{args.seq} {one * 1e3:.1f} ms "
                    f"({args.seq / one:,.0f} tok/s), {args.adapters}x{args.seq} "
                    f"{many * 1e3:.1f} ms ({args.adapters * args.seq / many:,.0f} tok/s)")
            if not args.skip_sampling:
                r = run_workload(eng, fanout, args, torch.cuda.synchronize, "new", True)
                line += (f"; fan-out {r['call tok/s']:,.0f} tok/s a call, decode step "
                         f"{r['step ms']:.2f} ms")
            line += f"; bf16 logits max|diff| vs none {diff:.3g}"
            print(line, flush=True)
            text += f"- {line.strip()}\n"
    emit(text, args.write)


if __name__ == "__main__":
    main()
