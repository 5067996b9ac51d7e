"""Sampling throughput of the engine: continuous batching over a paged KV cache (what
`Engine.sample` runs) against the padded sampler it replaced, on the same card and weights.

Two workloads, `--adapters` adapters (8; LoRA r=32 on attention and MLP), every sample runs
to its `--new` tokens:
  fan-out: `--prompts-fanout` prompts of `--prompt` tokens x `--samples` samples each,
           temperature 1 (an RL rollout);
  wide:    `--prompts-wide` prompts of `--prompt` tokens x 1 sample, greedy.
Each prints new tokens per second of a whole `sample` call (prefill included), of its
decode steps alone (those that admit no prompt: a wide workload's prompts are prefilled
over its first steps, `prefill_tokens` at a time), and the decode steps' share of a
bandwidth bound: the bytes a decode step must read (base weights, the adapters in use,
every row's KV so far) over `--bandwidth-gbs`. Calls are timed after a warm-up call (which
captures the CUDA graphs): the median call, and the decode steps of all timed calls.
`--paths old,new` runs both decode attentions on the same weights, one after the other: old
is the gather + SDPA reference (kernels off), new the paged Triton kernel
(kernels/paged_decode.py; on CPU only under TRITON_INTERPRET=1), and prints new/old; flat
is new without the cascade (each sample reads its shared prompt pages itself).
`--prefill padded,varlen` runs each with the padded prefill pass (prompts right-padded into
one batch, never chunked: the pass before) and the varlen one (prompts packed end to end,
chunked to `--prefill-tokens` a step: engine/prefill_queue.py), and prints varlen/padded
and each call's seconds in steps that prefilled ("prefill s").
`--overlap on,off` runs each with the decode loop overlapped (the next step launched before
the host records the last: engine/decode_loop.py) and synchronous; "waits" is how long the
host waited for a step's results (near 0: the host is the bottleneck). `--workloads fanout`
(or wide) runs one workload alone.

    python bench/bench_sampling.py                      # CPU, the tiny model
    python bench/bench_sampling.py --device cuda --shape qwen2.5-0.5b
    python bench/bench_sampling.py --device cuda --shape qwen3-8b --paths old,new --adapters 64
    python bench/bench_sampling.py --device cuda --shape qwen3-8b --paths new --prefill padded,varlen
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_engine import build_model, header
from output import emit, section_path

from twinkled.engine import choose
from twinkled.engine.engine import Engine
from twinkled.engine.fused_ops import Fused
from twinkled.engine.recurrent import SlotStates
from twinkled.engine.running import PAGE_SIZE, RunningBatch
from twinkled.engine.sampler import generate_padded
from twinkled.protocol.types import LoraConfig, SampleRequest, SamplingParams

RANK = 32
# path: (LoRA and paged-attention kernels, cascade attention, grouped LoRA launches, the
# fused token choice (choose.FUSED: kernels/sample_rows.py))
PATHS = {"old": (False, False, False, False), "flat": (True, False, True, False),
         "new": (True, True, True, True), "ungrouped": (True, True, False, True),
         "unfused": (True, True, True, False)}


def workloads(args, vocab: int) -> dict[str, list[SampleRequest]]:
    gen = torch.Generator().manual_seed(0)

    def prompts(n: int) -> list[list[int]]:
        return [torch.randint(0, vocab, (args.prompt,), generator=gen).tolist() for _ in range(n)]

    hot = SamplingParams(max_tokens=args.new, temperature=1.0, seed=1, stop=[])
    greedy = SamplingParams(max_tokens=args.new, temperature=0.0, stop=[])
    return {
        f"fan-out: {args.prompts_fanout} prompts x {args.samples} samples, temperature 1": [
            SampleRequest(f"a{i % args.adapters}", p, hot, num_samples=args.samples)
            for i, p in enumerate(prompts(args.prompts_fanout))],
        f"wide: {args.prompts_wide} prompts x 1 sample, greedy": [
            SampleRequest(f"a{i % args.adapters}", p, greedy)
            for i, p in enumerate(prompts(args.prompts_wide))],
    }


def step_bytes(eng: Engine, rows: int, mean_len: float, adapters: int) -> float:
    """What one decode step must read: every linear weight once (the embedding only for
    its rows), the `adapters` in use, and each row's keys and values."""
    m = eng.model
    size = m.dtype.itemsize
    # (an MoE target is (in, out, experts): at a few hundred rows every expert is read)
    weights = sum(t[0] * t[1] * (t[2] if len(t) == 3 else 1) for t in m.targets.values()) * size
    lora = adapters * RANK * sum((t[0] + t[1]) * (t[2] if len(t) == 3 else 1)
                                 for key, t in m.targets.items() if key != "lm_head") * size
    heads, k_dim, v_dim = m.kv_shape  # (MLA: one latent "head", no values)
    kv = m.kv_layers * heads * (k_dim + v_dim) * size
    return weights + lora + rows * mean_len * kv


def kv_bytes(eng: Engine, reqs: list[SampleRequest], args) -> int:
    """A page pool that holds the whole workload at once (every row decoding together),
    unless `--kv-gb` says otherwise."""
    if args.kv_gb:
        return int(args.kv_gb * 1e9)
    m = eng.model
    per_token = 2 * m.kv_layers * m.n_kv * m.head_dim * m.dtype.itemsize
    pages = sum(1 + args.prompt // args.page_size + r.num_samples * (
        2 + args.new // args.page_size) for r in reqs)
    # Qwen3.5: every row's linear-attention state comes out of the same budget, at most
    # half of it (SlotStates.fit); without them here the batch ran one row at a time
    states = 0 if m.hybrid is None else batch_rows(reqs) * SlotStates.row_bytes(m)
    return max(pages * args.page_size * per_token + states, 2 * states)


def batch_rows(reqs: list[SampleRequest]) -> int:
    """The running batch's rows: every sample of the workload at once, 256 at least."""
    return max(256, sum(r.num_samples for r in reqs))


def profile_steps(batch: RunningBatch, reqs, adapters, tickets_of: int, steps: int = 4) -> str:
    """The kernels of `steps` decode steps (after prefill), heaviest first."""
    from torch.profiler import ProfilerActivity, profile

    batch.admit(reqs, adapters)
    done = len(batch.step())
    while batch.waiting_requests or batch.prefilling.pending:  # decode steps only
        done += len(batch.step())
    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            done += len(batch.step())
    while done < tickets_of:
        done += len(batch.step())
    key = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=60)


def run_workload(eng: Engine, reqs: list[SampleRequest], args, sync, path: str,
                 overlap: bool, prefill: str = "varlen") -> dict[str, float]:
    kernels, cascade, grouped, fused_choice = PATHS[path]
    eng.model.fuse_lora = grouped  # (the sampler's forward reads it; training is not run here)
    choose.FUSED = fused_choice
    adapters = [eng.pool.get(r.adapter_id) for r in reqs]
    rows = sum(r.num_samples for r in reqs)
    new = rows * args.new
    batch = RunningBatch(eng.model, rows=batch_rows(reqs), page_size=args.page_size,
                         kv_bytes=kv_bytes(eng, reqs, args), kernels=kernels, cascade=cascade,
                         overlap=overlap, prefill=prefill, prefill_tokens=args.prefill_tokens)
    calls, pure = [], []  # pure: (seconds, rows) of decode steps that admitted nothing
    prefilling = 0.0  # seconds of the timed calls' steps that admitted or prefilled
    for i in range(args.repeats + 1):  # the first call captures the graphs
        tickets = batch.admit(reqs, adapters)
        sync()
        t0 = time.perf_counter()
        finished = {}
        if i == 1:
            batch.loop.waited = 0.0
        while len(finished) < len(tickets):  # (no sync a step: a step may be in flight)
            admitting = batch.waiting_requests > 0 or batch.prefilling.pending
            live = len(batch.live)
            s0 = time.perf_counter()
            finished.update((f.ticket, f.result) for f in batch.step())
            if i > 0 and live and not admitting:
                pure.append((time.perf_counter() - s0, live))
            elif i > 0 and admitting:
                prefilling += time.perf_counter() - s0
        sync()
        calls.append(time.perf_counter() - t0)
    waited = batch.loop.waited
    call = statistics.median(calls[1:])
    step = sum(t for t, _ in pure) / len(pure)
    top = profile_steps(batch, reqs, adapters, tickets_of=len(reqs)) if args.profile else ""
    out = {"profile": top, "call tok/s": new / call, "prefill s": prefilling / args.repeats,
           "decode tok/s": sum(n for _, n in pure) / sum(t for t, _ in pure),
           "graphs": batch.decode.count_graphs(), "step ms": 1e3 * step,
           "wait ms": 1e3 * waited / max(1, len(pure)),
           "tokens": [s.tokens for t in tickets for s in finished[t].sequences]}
    mean_len = args.prompt + args.new / 2
    used = min(args.adapters, len(reqs))
    bound = rows * args.bandwidth_gbs * 1e9 / step_bytes(eng, rows, mean_len, used)
    out["bound tok/s"] = bound
    out["of bound"] = out["decode tok/s"] / bound
    out["GB/step"] = step_bytes(eng, rows, mean_len, used) / 1e9
    del batch
    if args.baseline and not kernels and overlap and prefill == "varlen":  # once: it does not depend on the decode attention
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
    ap.add_argument("--bandwidth-gbs", type=float, default=None,
                    help="the card's memory bandwidth, GB/s (default: by its name, H200 4800, "
                    "else the H100 SXM's 3350)")
    ap.add_argument("--no-baseline", dest="baseline", action="store_false",
                    help="skip the padded sampler")
    ap.add_argument("--paths", default=None,
                    help="decode attentions to run, comma-separated: old (gather + SDPA), new "
                    "(paged Triton kernel, cascade), flat (paged kernel, no cascade), "
                    "ungrouped (new with one LoRA launch pair a module, not a q/k/v or "
                    "gate/up group), unfused (new with the reference token choice, not "
                    "the fused kernel) (old,new; CPU old)")
    ap.add_argument("--cascade-tune", default=None,
                    help="JSON of the cascade's launch knobs (kernels/paged_decode.TUNE; "
                    "check_paged_decode.py --cascade --sweep writes one)")
    ap.add_argument("--overlap", default="on",
                    help="decode loops to run, comma-separated: on (overlapped), off "
                    "(synchronous) (on)")
    ap.add_argument("--prefill", default="varlen",
                    help="prefill passes to run, comma-separated: varlen (packed, chunked), "
                    "padded (the pass before) (varlen)")
    ap.add_argument("--prefill-tokens", type=int, default=None,
                    help="prompt tokens a step prefills (default: RunningBatch's, 16384 on CUDA)")
    ap.add_argument("--workloads", default="fanout,wide",
                    help="workloads to run, comma-separated: fanout, wide")
    ap.add_argument("--profile", action="store_true",
                    help="print the heaviest kernels of a few decode steps of each run")
    ap.add_argument("--adapters", type=int, default=8, help="adapters the requests cycle over")
    ap.add_argument("--page-size", type=int, default=PAGE_SIZE, help="tokens per KV page")
    ap.add_argument("--kv-gb", type=float, default=None,
                    help="KV page pool, GB (default: the whole workload at once)")
    ap.add_argument("--fused", default="all",
                    help="the layer's fused kernels (engine/fused_ops.py): all, none, or levers "
                    "comma-separated of norm, rope, silu, gemm, prep (the decode step's q/k kernel)")
    ap.add_argument("--direct", choices=("on", "off"), default=None,
                    help="the paged decode's split kernel writes a row's output where it is "
                    "the row's only part (kernels/paged_decode.DIRECT; default: the module's)")
    ap.add_argument("--write", default=section_path("sampling"))
    args = ap.parse_args()
    if args.direct is not None:
        from twinkled.engine.kernels import paged_decode

        paged_decode.DIRECT = args.direct == "on"
        print(f"paged decode: one part a row written directly {paged_decode.DIRECT}")
    if args.cascade_tune:
        import json

        from twinkled.engine.kernels import paged_decode

        paged_decode.TUNE.update(json.loads(args.cascade_tune))
        print(f"cascade tuning {paged_decode.TUNE}")
    if args.bandwidth_gbs is None:  # the datasheet figure of the card this runs on
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
        args.bandwidth_gbs = 4800.0 if "H200" in name else 3350.0
    gpu = args.device == "cuda"
    paths = (args.paths or ("old,new" if gpu else "old")).split(",")
    if any(p not in PATHS for p in paths):
        ap.error(f"--paths takes {', '.join(PATHS)}")
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
        eng.model.fused = Fused.parse(args.fused)
        for i in range(args.adapters):
            eng.add_adapter(f"a{i}", LoraConfig(rank=RANK, alpha=RANK, seed=i,
                                                train_unembed=False))
            a = eng.pool.get(f"a{i}")
            for key in a.bank.shapes:  # B starts at zero; give the deltas some size
                torch.nn.init.normal_(a.bank.B[key][a.slot], std=0.01)
        results = {}
        for name, reqs in workloads(args, vocab).items():
            if name.split(":")[0].replace("-", "") not in args.workloads.split(","):
                continue
            for path, ov, pf in itertools.product(paths, args.overlap.split(","),
                                                  args.prefill.split(",")):
                r = results[name, path, ov, pf] = run_workload(eng, reqs, args, sync, path,
                                                               ov == "on", pf)
                print(f"{name}, {path}, overlap {ov}, prefill {pf}: {r['call tok/s']:,.0f} "
                      f"tok/s a call, {r['prefill s']:.3f} s prefilling, {r['step ms']:.2f} ms "
                      f"a decode step, host waited {r['wait ms']:.2f} ms a step", flush=True)
    for (name, path, ov, pf), r in results.items():  # the loops and passes must sample alike
        for what, other in (("overlap on/off", results.get((name, path, "off", pf))),
                            ("prefill varlen/padded", results.get((name, path, ov, "padded")))):
            if other is not None and other is not r and (ov == "on" or pf == "varlen"):
                same = sum(a == b for a, b in zip(r["tokens"], other["tokens"], strict=True))
                print(f"{name}, {path}, {ov}, {pf}: {what} sampled the same tokens in {same} "
                      f"of {len(r['tokens'])} samples", flush=True)
    text = header(args.device).replace("Engine vs peft", "Sampling throughput")
    text += (f"\n### {args.shape} ({args.device}, {str(dtype).split('.')[-1]}), "
             f"{args.adapters} adapters r={RANK}, prompts of {args.prompt} tokens, {args.new} "
             f"new tokens a sample, pages of {args.page_size}, bandwidth bound at "
             f"{args.bandwidth_gbs:g} GB/s, fused {args.fused}, median of {args.repeats}; old: "
             f"gather + SDPA, new: paged kernel with cascade, flat: without; waits: ms a step "
             f"the host waited for results\n\n"
             f"| workload | path | overlap | prefill | call tok/s | prefill s | decode tok/s | "
             f"step ms | waits | bound tok/s | of bound | GB/step | graphs | call new/old | "
             f"call varlen/padded | padded tok/s |\n"
             f"|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    for (name, path, ov, pf), r in results.items():
        padded = r.get("padded tok/s")
        text += (f"| {name} | {path} | {ov} | {pf} | {r['call tok/s']:,.0f} | "
                 f"{r['prefill s']:.3f} | {r['decode tok/s']:,.0f} | {r['step ms']:.2f} | "
                 f"{r['wait ms']:.2f} | {r['bound tok/s']:,.0f} | {r['of bound']:.1%} | "
                 f"{r['GB/step']:.2f} | {r['graphs']:.0f} | "
                 f"{_ratio(r, results.get((name, 'old', ov, pf)), path == 'old')} | "
                 f"{_ratio(r, results.get((name, path, ov, 'padded')), pf == 'padded')} | "
                 + ("-" if padded is None else f"{padded:,.0f}") + " |\n")
    for (name, path, ov, pf), r in results.items():
        if r["profile"]:
            text += f"\n{name}, {path}, overlap {ov}, prefill {pf}: 4 decode steps\n```\n{r['profile']}```\n"
    emit(text, args.write)


def _ratio(r: dict, base: dict | None, same: bool) -> str:
    """r's call tok/s over base's ("-" where r is the base or there is none)."""
    return "-" if same or base is None else f"{r['call tok/s'] / base['call tok/s']:.2f}x"


if __name__ == "__main__":
    main()
