"""The sampler's logprobs against the trainer's, on a model shape: how far apart the two
forwards put the same tokens (issue 31, item 4; docs/reference.md "Sampler vs trainer
logprobs"). Target: a mean |gap| of at most 0.01 nats per token on bf16.

Samples `--prompts` prompts of `--prompt` tokens x `--samples` samples of `--new` tokens
through 8 adapters (LoRA r=32, B given some size) at temperature 1, as an RL rollout does,
then scores every sequence again through the training forward (Engine.logprob_gap, what the
daemon's running figure calls) and prints the mean |gap| per token (weighted by tokens), the
mean of each sequence's largest and the largest of all; for the running batch
(`Engine.sample`, what the daemon runs) and, with `--padded`, the padded reference sampler.
Random weights: the distributions are flatter than a trained model's, and a real model's
figure may differ; the comparison of paths and dtypes holds.

`--paths` also scores the running batch's samples again through each path of the two
sides, one difference at a time (gap_paths.py): where the two part. `--reference` adds an
fp32 copy of the model (a small shape: it holds the model twice).

    python bench/bench_gap.py                                  # CPU, the tiny model, fp32
    python bench/bench_gap.py --device cuda --shape qwen3-8b   # bf16
    python bench/bench_gap.py --device cuda --shape qwen3-8b --paths
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import gap_paths
import torch
from bench_engine import build_model, header, random_adapters
from output import emit, section_path

from twinkled.engine.engine import Engine
from twinkled.engine.sampler import generate_padded
from twinkled.protocol.types import LogprobGap, SampleRequest, SamplingParams

ADAPTERS = 8
RANK = 32


def requests(args, vocab: int) -> list[SampleRequest]:
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.new, temperature=1.0, seed=1, stop=[])
    return [SampleRequest(f"a{i % ADAPTERS}",
                          torch.randint(0, vocab, (args.prompt,), generator=gen).tolist(),
                          params, num_samples=args.samples) for i in range(args.prompts)]


def gaps(eng: Engine, reqs: list[SampleRequest], results) -> list[LogprobGap]:
    return [eng.logprob_gap(req.adapter_id, req.prompt, seq.tokens, seq.logprobs)
            for req, res in zip(reqs, results, strict=True) for seq in res.sequences]


def summary(name: str, found: list[LogprobGap], seconds: float) -> str:
    tokens = sum(g.tokens for g in found)
    mean = sum(g.mean * g.tokens for g in found) / tokens
    seq_max = sum(g.max for g in found) / len(found)
    return (f"| {name} | {len(found)} | {tokens:,} | {mean:.3g} | {seq_max:.3g} | "
            f"{max(g.max for g in found):.3g} | {seconds:.1f} |\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="tiny", help="tiny, qwen2.5-0.5b or qwen3-8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="bfloat16 or float32 (GPU bfloat16; CPU "
                    "float32)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (512; CPU 32)")
    ap.add_argument("--new", type=int, default=None, help="new tokens a sample (256; CPU 16)")
    ap.add_argument("--prompts", type=int, default=None, help="(8; CPU 4)")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--padded", action="store_true", help="also the padded reference sampler")
    ap.add_argument("--paths", action="store_true", help="where the two part (gap_paths.py)")
    ap.add_argument("--reference", action="store_true", help="with --paths: an fp32 copy too")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (not tiny)")
    ap.add_argument("--write", default=section_path("gap"))
    args = ap.parse_args()
    gpu = args.device == "cuda"
    for name, g, c in (("prompt", 512, 32), ("new", 256, 16), ("prompts", 8, 4)):
        if getattr(args, name) is None:
            setattr(args, name, g if gpu else c)
    dtype = getattr(torch, args.dtype or ("bfloat16" if gpu else "float32"))
    rows = where = ""
    with tempfile.TemporaryDirectory() as tmp:
        vocab = build_model(args.shape, Path(tmp) / "model", dtype, args.device, args.layers)
        eng = Engine(Path(tmp) / "model", dtype=dtype, device=args.device)
        names = random_adapters(eng, ADAPTERS, RANK)
        reqs = requests(args, vocab)
        paths = {"running batch (Engine.sample)": lambda: eng.sample(reqs)}
        if args.padded:
            adapters = [eng.pool.get(r.adapter_id) for r in reqs]
            paths["padded sampler"] = lambda: generate_padded(eng.model, reqs, adapters)
        for name, run in paths.items():
            results = run()
            t0 = time.perf_counter()
            found = gaps(eng, reqs, results)
            rows += summary(name, found, time.perf_counter() - t0)
            if args.paths and name.startswith("running"):
                ref = (gap_paths.reference_engine(eng, Path(tmp) / "model", names)
                       if args.reference else None)
                where = gap_paths.table(gap_paths.paths(
                    eng, gap_paths.sequences(reqs, results), ref))
    shape = args.shape + (f" ({args.layers} layers)" if args.layers else "")
    title = (f"{shape} ({args.device}, {str(dtype).split('.')[-1]}), {ADAPTERS} adapters "
             f"r={RANK}, {args.prompts} prompts of {args.prompt} tokens x {args.samples} "
             f"samples of {args.new} new tokens, temperature 1; |gap| in nats per token "
             "(target: mean <= 0.01 on bf16)")
    table = ["| sampler | sequences | tokens | mean \\|gap\\| | mean of sequence max | "
             "max \\|gap\\| | scoring s |", "|---|---:|---:|---:|---:|---:|---:|"]
    text = "\n".join([header(args.device).replace("Engine vs peft", "Sampler vs trainer "
                                                   "logprobs"), f"### {title}", "", *table])
    text += "\n" + rows
    if where:
        text += ("\nThe same samples scored again through each path (teacher-forced); Δ in "
                 "nats per token:\n\n" + where)
    emit(text, args.write)


if __name__ == "__main__":
    main()
