"""RL-style fan-out: N samples of one prompt against one sample, with the prompt prefilled
once (the default: `Engine.sample`, the running batch over shared KV pages) and once per
sample (the padded reference), in the same run.

    python bench/bench_fanout.py                      # CPU, the tiny model
    python bench/bench_fanout.py --device cuda --shape qwen2.5-0.5b
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_engine import build_model, header
from output import emit, section_path

from twinkled.engine.engine import Engine
from twinkled.engine.sampler import generate
from twinkled.protocol.types import LoraConfig, SampleRequest, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt", type=int, default=400)
    ap.add_argument("--new", type=int, default=32, help="tokens generated per sample")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--write", default=section_path("fanout"))
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    with tempfile.TemporaryDirectory() as tmp:
        build_model(args.shape, Path(tmp) / "model", dtype, args.device)
        eng = Engine(Path(tmp) / "model", dtype=dtype, device=dev)
        eng.add_adapter("a", LoraConfig(rank=32, alpha=32, seed=0))
        gen = torch.Generator().manual_seed(0)
        # A new prompt each repetition, as an RL step's are: the prefix cache would otherwise
        # serve every repetition after the first without a prefill (the "cached" rows).
        prompts = [torch.randint(0, eng.model.vocab_size, (args.prompt,), generator=gen).tolist()
                   for _ in range(args.repeats + 1)]
        adapter = [eng.pool.get("a")]

        def timed(n: int, share: bool, fresh: bool = True) -> float:
            params = SamplingParams(max_tokens=args.new, temperature=1.0, seed=1, stop=[])
            out = []
            for r in range(args.repeats + 1):
                prompt = prompts[r] if fresh else prompts[0]
                # (a different first token: this configuration's prompt is not cached yet)
                prompt = [(prompt[0] + n + 2 * share) % eng.model.vocab_size, *prompt[1:]]
                req = [SampleRequest("a", prompt, params, num_samples=n)]
                sync()
                t0 = time.perf_counter()
                if share:
                    eng.sample(req)
                else:
                    generate(eng.model, req, adapter, share_prefill=False)
                sync()
                out.append(time.perf_counter() - t0)
            return statistics.median(out[1:])

        one = timed(1, True)
        rows = [(f"{args.samples} samples, prefilled once", timed(args.samples, True)),
                (f"{args.samples} samples, prefilled per sample", timed(args.samples, False))]
        cached = timed(1, True, fresh=False)  # the prompt's KV from the prefix cache
        rows += [("1 sample, the prompt cached", cached),
                 (f"{args.samples} samples, the prompt cached",
                  timed(args.samples, True, fresh=False))]
    text = header(args.device).replace("Engine vs peft", "Sampling fan-out")
    text += (f"\n### {args.shape} ({args.device}, {str(dtype).split('.')[-1]}), prompt "
             f"{args.prompt} tokens, {args.new} new tokens per sample, temperature 1, median "
             f"of {args.repeats}, a new prompt each (cached rows: the same prompt again)\n\n| run | seconds | vs 1 sample |\n|---|---:|---:|\n"
             f"| 1 sample | {one:.3f} | 1.00x |\n")
    for name, t in rows:
        text += f"| {name} | {t:.3f} | {t / one:.2f}x |\n"
    emit(text, args.write)


if __name__ == "__main__":
    main()
