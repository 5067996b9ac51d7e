"""Sampling throughput of the engine: continuous batching over a paged KV cache (what
`Engine.sample` runs) against the padded sampler it replaced, on the same card and weights.

Two workloads, 8 adapters (LoRA r=32 on attention and MLP), every sample runs to its
`--new` tokens:
  fan-out: `--prompts-fanout` prompts of `--prompt` tokens x `--samples` samples each,
           temperature 1 (an RL rollout);
  wide:    `--prompts-wide` prompts of `--prompt` tokens x 1 sample, greedy.
Each prints new tokens per second of a whole `sample` call (prefill included), of its
decode steps alone, and the decode steps' share of a bandwidth bound: the bytes a decode
step must read (base weights, the adapters in use, every row's KV so far) over
`--bandwidth-gbs`. Timings are medians after a warm-up call (which captures the CUDA graphs).

    python bench/bench_sampling.py                      # CPU, the tiny model
    python bench/bench_sampling.py --device cuda --shape qwen2.5-0.5b
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
from twinkled.engine.running import RunningBatch
from twinkled.engine.sampler import generate_padded
from twinkled.protocol.types import LoraConfig, SampleRequest, SamplingParams

ADAPTERS = 8
RANK = 32


def workloads(args, vocab: int) -> dict[str, list[SampleRequest]]:
    gen = torch.Generator().manual_seed(0)

    def prompts(n: int) -> list[list[int]]:
        return [torch.randint(0, vocab, (args.prompt,), generator=gen).tolist() for _ in range(n)]

    hot = SamplingParams(max_tokens=args.new, temperature=1.0, seed=1, stop=[])
    greedy = SamplingParams(max_tokens=args.new, temperature=0.0, stop=[])
    return {
        f"fan-out: {args.prompts_fanout} prompts x {args.samples} samples, temperature 1": [
            SampleRequest(f"a{i % ADAPTERS}", p, hot, num_samples=args.samples)
            for i, p in enumerate(prompts(args.prompts_fanout))],
        f"wide: {args.prompts_wide} prompts x 1 sample, greedy": [
            SampleRequest(f"a{i % ADAPTERS}", p, greedy) for i, p in enumerate(prompts(args.prompts_wide))],
    }


def step_bytes(eng: Engine, rows: int, mean_len: float) -> float:
    """What one decode step must read: every linear weight once (the embedding only for
    its rows), the adapters in use, and each row's keys and values."""
    m = eng.model
    size = m.dtype.itemsize
    weights = sum(fin * fout for fin, fout in m.targets.values()) * size
    lora = ADAPTERS * RANK * sum(fin + fout for key, (fin, fout) in m.targets.items()
                                 if key != "lm_head") * size
    kv = 2 * len(m.layers) * m.n_kv * m.head_dim * size
    return weights + lora + rows * mean_len * kv


def run_workload(eng: Engine, reqs: list[SampleRequest], args, sync) -> dict[str, float]:
    adapters = [eng.pool.get(r.adapter_id) for r in reqs]
    rows = sum(r.num_samples for r in reqs)
    new = rows * args.new
    batch = RunningBatch(eng.model, rows=max(256, rows))
    calls, decode = [], []
    for _ in range(args.repeats + 1):  # the first call captures the graphs
        tickets = batch.admit(reqs, adapters)
        sync()
        t0 = time.perf_counter()
        first = batch.step()  # admission (prefill) and the first decode step
        sync()
        t1 = time.perf_counter()
        done = len(first)
        while done < len(tickets):
            done += len(batch.step())
        sync()
        t2 = time.perf_counter()
        calls.append(t2 - t0)
        decode.append(t2 - t1)
    call, dec = statistics.median(calls[1:]), statistics.median(decode[1:])
    out = {"call tok/s": new / call, "decode tok/s": rows * (args.new - 2) / dec,
           "graphs": batch.decode.count_graphs()}
    mean_len = args.prompt + args.new / 2
    bound = rows * args.bandwidth_gbs * 1e9 / step_bytes(eng, rows, mean_len)
    out["bound tok/s"] = bound
    out["of bound"] = out["decode tok/s"] / bound
    out["GB/step"] = step_bytes(eng, rows, mean_len) / 1e9
    if args.baseline:
        times = []
        for _ in range(max(1, args.repeats - 1) + 1):
            sync()
            t0 = time.perf_counter()
            generate_padded(eng.model, reqs, adapters)
            sync()
            times.append(time.perf_counter() - t0)
        out["padded tok/s"] = new / statistics.median(times[1:])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="tiny", help="tiny, qwen2.5-0.5b or qwen3-8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (512; CPU 32)")
    ap.add_argument("--new", type=int, default=None, help="new tokens a sample (256; CPU 16)")
    ap.add_argument("--prompts-fanout", type=int, default=None, help="(32; CPU 4)")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompts-wide", type=int, default=None, help="(256; CPU 16)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bandwidth-gbs", type=float, default=3350.0,
                    help="the card's memory bandwidth, GB/s (H100 SXM: 3350; H200: 4800)")
    ap.add_argument("--no-baseline", dest="baseline", action="store_false",
                    help="skip the padded sampler")
    ap.add_argument("--write", default=section_path("sampling"))
    args = ap.parse_args()
    gpu = args.device == "cuda"
    for name, g, c in (("prompt", 512, 32), ("new", 256, 16), ("prompts_fanout", 32, 4),
                       ("prompts_wide", 256, 16)):
        if getattr(args, name) is None:
            setattr(args, name, g if gpu else c)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if gpu else torch.float32
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    with tempfile.TemporaryDirectory() as tmp:
        vocab = build_model(args.shape, Path(tmp) / "model", dtype, args.device)
        eng = Engine(Path(tmp) / "model", dtype=dtype, device=dev)
        for i in range(ADAPTERS):
            eng.add_adapter(f"a{i}", LoraConfig(rank=RANK, alpha=RANK, seed=i,
                                                train_unembed=False))
            a = eng.pool.get(f"a{i}")
            for key in a.bank.shapes:  # B starts at zero; give the deltas some size
                torch.nn.init.normal_(a.bank.B[key][a.slot], std=0.01)
        results = {name: run_workload(eng, reqs, args, sync)
                   for name, reqs in workloads(args, vocab).items()}
    text = header(args.device).replace("Engine vs peft", "Sampling throughput")
    text += (f"\n### {args.shape} ({args.device}, {str(dtype).split('.')[-1]}), {ADAPTERS} "
             f"adapters r={RANK}, prompts of {args.prompt} tokens, {args.new} new tokens a "
             f"sample, bandwidth bound at {args.bandwidth_gbs:g} GB/s, median of "
             f"{args.repeats}\n\n| workload | call tok/s | decode tok/s | bound tok/s | "
             f"of bound | GB/step | graphs | padded tok/s | call vs padded |\n"
             f"|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    for name, r in results.items():
        padded = r.get("padded tok/s")
        text += (f"| {name} | {r['call tok/s']:,.0f} | {r['decode tok/s']:,.0f} | "
                 f"{r['bound tok/s']:,.0f} | {r['of bound']:.1%} | {r['GB/step']:.2f} | "
                 f"{r['graphs']:.0f} | "
                 + ("- | - |" if padded is None else
                    f"{padded:,.0f} | {r['call tok/s'] / padded:.2f}x |") + "\n")
    emit(text, args.write)


if __name__ == "__main__":
    main()
