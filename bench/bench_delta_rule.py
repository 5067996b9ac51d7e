"""Qwen3.5's gated delta rule alone (linear attention, forward and backward): ours
(engine/linear_attn.delta_rule, the torch rule the engine trains with where fla-core's
backward is refused) against transformers' torch_chunk_gated_delta_rule and fla-core's
Triton kernel (forward; its backward where it runs), on the 9B's heads.

    python bench/bench_delta_rule.py                 # CUDA: 8 rows x 512, the 9B's heads
    python bench/bench_delta_rule.py --device cpu --rows 1 --seq 128 --heads 4 --dim 16
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from output import emit, section_path

from twinkled.engine import linear_attn as la


def inputs(args, dtype):
    dev, N, L, H, d = args.device, args.rows, args.seq, args.heads, args.dim
    q = (F.normalize(torch.randn(N, L, H, d, device=dev), dim=-1) * d ** -0.5).to(dtype)
    k = F.normalize(torch.randn(N, L, H, d, device=dev), dim=-1).to(dtype)
    v = torch.randn(N, L, H, d, device=dev).to(dtype)
    g = -F.softplus(torch.randn(N, L, H, device=dev))
    beta = torch.rand(N, L, H, device=dev).to(dtype)
    for t in (q, k, v):
        t.requires_grad_(True)
    return q, k, v, g, beta


def ours(q, k, v, g, beta):
    return la.delta_rule(q, k, v, g, beta, None)[0]


def transformers_rule(q, k, v, g, beta):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    rule = m.torch_chunk_gated_delta_rule
    rule = getattr(rule, "__wrapped__", rule)  # (the hub-kernel wrapper would pick fla)
    return rule(q, k, v, g, beta, initial_state=None, output_final_state=False)[0]


def fla_rule(q, k, v, g, beta):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule(q, k, v, g, beta, scale=1.0)[0]


def time_ms(args, fn, backward: bool) -> float:
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    x = inputs(args, torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    times = []
    for i in range(args.warmup + args.reps):
        sync()
        t0 = time.perf_counter()
        o = fn(*x)
        if backward:
            o.float().square().mean().backward()
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--heads", type=int, default=32, help="value heads (keys repeated to them)")
    ap.add_argument("--dim", type=int, default=128, help="head size of keys and values")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--torch-dqkwg", action="store_true",
                    help="fla's backward with our torch chunk_bwd_dqkwg where fla refuses its "
                    "own (linear_attn.TORCH_DQKWG; Hopper under Triton < 3.7.1)")
    ap.add_argument("--write", default=section_path("delta_rule"))
    args = ap.parse_args()
    if args.torch_dqkwg:
        la.TORCH_DQKWG = True
        la.fla_backward_broken.cache_clear()
    rules = [("ours (engine/linear_attn.delta_rule)", ours, True),
             ("transformers' torch_chunk_gated_delta_rule", transformers_rule, True)]
    if la.fla_usable(torch.zeros(1, device=args.device)):
        patched = " (our torch dqkwg)" if args.torch_dqkwg else ""
        rules.append((f"fla-core's chunk_gated_delta_rule{patched}", fla_rule,
                      not la.fla_backward_broken()))
    card = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    text = (f"### The gated delta rule alone: {args.rows} rows x {args.seq} tokens, "
            f"{args.heads} heads of {args.dim}, {card}\n\n"
            "| rule | forward (ms a layer) | forward + backward (ms a layer) |\n|---|---:|---:|\n")
    for name, fn, backward in rules:
        fwd = time_ms(args, fn, False)
        both = f"{time_ms(args, fn, True):.2f}" if backward else "(backward refused here)"
        text += f"| {name} | {fwd:.2f} | {both} |\n"
        print(f"-- {name}: forward {fwd:.2f} ms, forward + backward {both}", flush=True)
    emit(text, args.write)


if __name__ == "__main__":
    main()
