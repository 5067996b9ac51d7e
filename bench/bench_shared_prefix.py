"""An RL step's training half with shared prefixes on and off (engine/shared_prefix.py).

Why: an RL batch holds G rollouts of each prompt. Run as separate rows, every rollout
computes its prompt again (80% of the tokens of a 512 + 128 step); shared, a group costs
prompt + G x completion. In one run, on one engine (one tenant, LoRA r=32 on q,k,v,o,gate,
up,down, importance_sampling with advantages on the completions), the same batch of P
prompts x G rollouts is trained with `shared_prefix` 0 (off) and on (the default minimum):

  rows, tokens computed, seconds per round (forward_backward + one AdamW step), row tok/s.

It also checks the two agree: the loss sum and the gradient, relative difference (fp32 on a
CPU: ~1e-6; bf16 on a GPU: rounding noise, ~1e-2). On a CPU shared with other jobs, one
torch thread gives steadier times (measured on a 2-core box: 8.3 s a round with 2 threads
fighting other processes, 1.4 s with one).

    OMP_NUM_THREADS=1 python bench/bench_shared_prefix.py --shape tiny --device cpu
    python bench/bench_shared_prefix.py --shape qwen3-8b      # GPU: 8 x 16, 512 + 128
    python bench/bench_shared_prefix.py --shape qwen3-8b --attention flash,gather
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from output import emit, section_path  # bench/ is the script's directory

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import (  # noqa: E402
    ALPHA,
    RANK,
    SHAPES,
    Row,
    build_model,
    free,
    header,
    measure,
    seed_all,
    sync,
)

from twinkled.engine import flash_varlen  # noqa: E402
from twinkled.engine.engine import Engine  # noqa: E402
from twinkled.engine.shared_prefix import MIN_SHARED, TOKENS  # noqa: E402
from twinkled.protocol.types import AdamParams, Datum, ForwardBackwardRequest, LoraConfig  # noqa: E402

# (prompts, rollouts each, prompt tokens, completion tokens, timed rounds)
CPU_SIZES = (8, 8, 256, 64, 3)
GPU_SIZES = (8, 16, 512, 128, 3)


def rl_batch(vocab: int, prompts: int, rollouts: int, prompt_len: int, new: int,
             seed: int = 0) -> list[Datum]:
    """P prompts x G rollouts of random tokens; advantages (one per rollout) on the
    completion only, sampler logprobs about where a random model puts them."""
    gen = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(prompts):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=gen)
        for _ in range(rollouts):
            seq = torch.cat([prompt, torch.randint(0, vocab, (new,), generator=gen)])
            n = len(seq) - 1
            adv = torch.zeros(n)
            adv[prompt_len - 1:] = float(torch.randn((), generator=gen))
            data.append(Datum(seq[:-1], {"target_tokens": seq[1:], "advantages": adv,
                                         "logprobs": torch.full((n,), -12.0)}))
    return data


def agreement(eng: Engine, req: ForwardBackwardRequest, minimum: int) -> tuple[float, float]:
    """Relative difference of the loss sum and of the gradient, shared vs not."""
    a = eng.pool.get("rl")
    out = []
    for m in (0, minimum):
        eng.shared_prefix = m
        eng.zero_grad("rl")
        loss = eng.forward_backward([req])[0].metrics["loss:sum"]
        out.append((loss, a.bank.flat(a.slot, "g").detach().float().clone()))
    eng.zero_grad("rl")
    (l0, g0), (l1, g1) = out
    return abs(l1 - l0) / max(abs(l0), 1e-12), float((g1 - g0).norm() / g0.norm().clamp_min(1e-30))


def profile_round(label: str, round_: Callable[[], None], device: str, top: int = 18) -> None:
    """One round under torch.profiler: its wall time against the device's busy time, and
    the ops that take the most device time (where a round's seconds go)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync(device)
    start = time.perf_counter()
    with profile(activities=acts) as prof:
        round_()
        sync(device)
    wall = time.perf_counter() - start
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events) / 1e6
    launches = sum(e.count for e in events if e.self_device_time_total > 0)
    print(f"-- profile {label}: wall {wall:.3f} s (profiled), device busy {busy:.3f} s, "
          f"{launches:,} device ops")
    print(events.table(sort_by="self_device_time_total" if device == "cuda"
                       else "self_cpu_time_total", row_limit=top, max_name_column_width=60))


def run_shape(shape: str, device: str, sizes: tuple, budget: int, modes: list[str],
              profile: bool = False) -> str:
    prompts, rollouts, prompt_len, new, rounds = sizes
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with tempfile.TemporaryDirectory(prefix="bench_shared_") as tmp:
        vocab = build_model(shape, Path(tmp), dtype, device)
        seed_all(1)
        eng = Engine(tmp, dtype=dtype, device=device, max_rank=RANK, token_budget=budget)
        eng.add_adapter("rl", LoraConfig(rank=RANK, alpha=ALPHA, seed=0, train_unembed=False))
        req = ForwardBackwardRequest("rl", rl_batch(vocab, prompts, rollouts, prompt_len, new),
                                     "importance_sampling")
        adam = AdamParams(learning_rate=1e-5)
        # lora_B starts at zero, so A would have no gradient to compare: one step first.
        eng.forward_backward([req])
        eng.optim_steps([("rl", AdamParams(learning_rate=1e-3))])
        agree = {}
        rows: list[tuple[Row, int]] = []
        for mode, label, minimum in [(m, *x) for m in modes for x in (
                ("unshared (shared_prefix = 0)", 0),
                (f"shared (shared_prefix = {MIN_SHARED})", MIN_SHARED))]:
            flash_varlen.ENABLED = flash_varlen.SHARED = mode == "flash"
            if mode not in agree:
                agree[mode] = agreement(eng, req, MIN_SHARED)
            label = f"{label}, {mode}" if len(modes) > 1 else label
            eng.shared_prefix = minimum

            def round_() -> None:
                eng.forward_backward([req])
                eng.optim_steps([("rl", adam)])

            real = sum(len(d.tokens) for d in req.data)
            TOKENS.take()
            row = measure(label, real, round_, 1, rounds, device)
            seen, computed = TOKENS.take()
            if profile:
                profile_round(label, round_, device)
            rows.append((row, computed * real // seen))  # per round
    free(device)
    base = rows[0][0].seconds
    lines = [f"### {shape} ({device}, {str(dtype).removeprefix('torch.')}, one adapter r={RANK}, "
             f"importance_sampling; {prompts} prompts x {rollouts} rollouts, {prompt_len} + "
             f"{new} tokens; token_budget {budget})", "",
             "| test | row tokens/round | tokens computed | time per round (s) | row tok/s "
             "| speed-up | peak mem (GiB) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for row, computed in rows:
        mem = "-" if row.peak_gib is None else f"{row.peak_gib:.2f}"
        lines.append(f"| {row.test} | {row.tokens} | {computed} | {row.seconds:.4f} | "
                     f"{row.throughput:,.0f} | {base / row.seconds:.2f}x | {mem} |")
    for mode, (loss_diff, grad_diff) in agree.items():
        lines += ["", f"Shared vs unshared ({mode} attention), one forward_backward: loss sum "
                  f"differs by {loss_diff:.2e} (relative), the gradient by {grad_diff:.2e} "
                  "(relative norm)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", choices=SHAPES)
    ap.add_argument("--device", choices=("cpu", "cuda"),
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int)
    ap.add_argument("--rollouts", type=int)
    ap.add_argument("--prompt-len", type=int)
    ap.add_argument("--new", type=int, help="completion tokens")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--token-budget", type=int, default=16384)
    ap.add_argument("--attention", default="flash",
                    help="comma-separated: flash (flash's own varlen ops: kv heads as they are, "
                    "shared keys read in place, engine/flash_varlen.py), gather (varlen_attn "
                    "over repeated heads and gathered keys, the path before)")
    ap.add_argument("--out", default=None, help="the section's file ('' : print only)")
    ap.add_argument("--profile", action="store_true",
                    help="after each mode's timing, profile one more round: wall against "
                    "device busy time, the ops taking the most device time")
    args = ap.parse_args()
    sizes = list(GPU_SIZES if args.device == "cuda" else CPU_SIZES)
    for i, v in enumerate((args.prompts, args.rollouts, args.prompt_len, args.new, args.rounds)):
        if v is not None:
            sizes[i] = v
    shapes = args.shape or (["qwen2.5-0.5b"] if args.device == "cuda" else ["tiny"])
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    text = header(args.device).replace("Engine vs peft", "Shared prefixes in training")
    for shape in shapes:
        text += "\n" + run_shape(shape, args.device, tuple(sizes), args.token_budget,
                          args.attention.split(","), args.profile)
    emit(text, section_path("shared_prefix") if args.out is None else args.out)


if __name__ == "__main__":
    main()
