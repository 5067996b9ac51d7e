"""Sampling through the daemon against the engine alone (issue 31, item 5): N tenants, half
through the unmodified tinker 0.38 client and half through the official `openai` client
(the OpenAI face's `/completions`), each sending the RL fan-out workload at once, share the
daemon's running batch; the same requests then run in one `Engine.sample` call in-process
on the same weights and card. Reported: each side's new tokens/s and their ratio (the issue
asks >= 0.9x), and each tenant's seconds.

Each tenant has its own rank-`--rank` adapter (created through tinker, published with
`save_weights_for_sampler`; an OpenAI tenant names that path as its `model`), warms up with
one small request, then all tenants send `--prompts` random prompts of `--prompt-len` tokens,
`--samples` samples each, `--new` new tokens, temperature 1, together: a tinker tenant one
`sample` per prompt (sent at once), an OpenAI tenant one `completions` call with every
prompt (token ids) and `n = --samples`.

    python bench/bench_sample_daemon.py                                  # CPU, tiny model
    python bench/bench_sample_daemon.py --shape qwen3-8b --model-dir /tmp/q8b   # GPU
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_multitenant import (  # noqa: E402
    client_options,
    make_keys,
    model_dir_for,
    start_daemon,
)
from output import emit, section_path  # noqa: E402

T = 3600  # seconds any one client call may take


def prompts_of(args: argparse.Namespace, seed: int) -> list[list[int]]:
    """A tenant's prompts: the same for the daemon and the engine-alone run."""
    rng = random.Random(seed)
    return [[rng.randrange(5, args.vocab) for _ in range(args.prompt_len)]
            for _ in range(args.prompts)]


def tenant(args: argparse.Namespace) -> None:
    """One tenant process: its adapter, a warm-up, "ready", wait for "go", the workload."""
    import tinker

    sc = tinker.ServiceClient(base_url=args.url, api_key=args.key)
    tc = sc.create_lora_training_client(base_model=args.base_model, rank=args.rank,
                                        train_unembed=False)
    path = tc.save_weights_for_sampler(f"s{args.seed}").result(timeout=T).path
    prompts = prompts_of(args, args.seed)
    if args.face == "openai":
        import openai

        oai = openai.OpenAI(base_url=f"{args.url}/oai/api/v1", api_key=args.key, timeout=T)

        def run(ps: list[list[int]], n: int, new: int) -> int:
            r = oai.completions.create(model=path, prompt=ps, n=n, max_tokens=new,
                                       temperature=1.0)
            return r.usage.completion_tokens
    else:
        sampler = sc.create_sampling_client(model_path=path)

        def run(ps: list[list[int]], n: int, new: int) -> int:
            params = tinker.types.SamplingParams(max_tokens=new, temperature=1.0, stop=[])
            futs = [sampler.sample(tinker.types.ModelInput.from_ints(p), num_samples=n,
                                   sampling_params=params) for p in ps]
            return sum(len(s.tokens) for f in futs for s in f.result(timeout=T).sequences)
    run(prompts[:2], 2, 4)  # warm-up (the adapter in the sampler's bank)
    for _ in range(args.rounds):  # the first round captures the decode's graphs
        print("ready", flush=True)
        sys.stdin.readline()
        t0 = time.time()
        tokens = run(prompts, args.samples, args.new)
        print(json.dumps({"tokens": tokens, "t0": t0, "t1": time.time()}), flush=True)
    sys.stdin.readline()  # exit once every tenant is done: an exit is CPU the others lack


def through_daemon(args: argparse.Namespace, model: Path, work: Path, device: str,
                   config: Path | None) -> list[dict]:
    data = work / "data"
    shutil.rmtree(data, ignore_errors=True)  # (a run before, with another config)
    t0 = time.time()
    keys = make_keys(data, args.tenants)
    print(f"[{time.time() - t0:.0f} s] {args.tenants} keys made", flush=True)
    toml = work / "twinkled.toml"  # the config given, with the KV pool both sides use
    toml.write_text((config.read_text() if config else "") + f"\nsample_kv_mb = {args.kv_mb}\n")
    trace = work / "trace.jsonl"  # the ranks' decode figures (decode_figures)
    trace.unlink(missing_ok=True)
    os.environ["TWINKLED_TRACE"] = str(trace)
    daemon, url, log = start_daemon(model, data, work, device, "--config", str(toml))
    print(f"[{time.time() - t0:.0f} s] the daemon answers", flush=True)
    try:
        faces = ["tinker" if i % 2 == 0 else "openai" for i in range(args.tenants)]
        procs = [subprocess.Popen(
            [sys.executable, __file__, "--tenant", "--url", url, "--key", key, "--base-model",
             model.name, "--vocab", str(args.vocab), "--seed", str(i), "--face", face,
             "--rank", str(args.rank), "--rounds", str(args.rounds), "--prompts", str(args.prompts), "--samples",
             str(args.samples), "--prompt-len", str(args.prompt_len), "--new", str(args.new)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for i, (key, face) in enumerate(zip(keys, faces, strict=True))]
        rounds = []
        for i in range(args.rounds):
            rounds.append(one_round(procs, work))
            print(f"[{time.time() - t0:.0f} s] round {i + 1} through the daemon done", flush=True)
        for p in procs:
            p.stdin.write("done\n")
            p.stdin.flush()
        for p in procs:
            p.wait(timeout=60)
    finally:
        keep_log(args, url, work)
        daemon.terminate()
        daemon.wait(timeout=600)
        log.close()
    return [{"tokens": sum(r["tokens"] for r in res),
             "wall": max(r["t1"] for r in res) - min(r["t0"] for r in res), "faces": faces,
             "each": [r["t1"] - r["t0"] for r in res],
             "decode": decode_figures(trace, min(r["t0"] for r in res),
                                      max(r["t1"] for r in res))} for res in rounds]


def decode_figures(trace: Path, t0: float, t1: float) -> dict[str, float]:
    """The running batch's figures (engine/step.py HostTime.note) summed over the ranks'
    steps sent between `t0` and `t1`, from the daemon's trace: decode steps, their rows,
    prefill and decode seconds, and the ranks' busy seconds."""
    sums: dict[str, float] = {"busy s": 0.0}
    if not trace.exists():
        return sums
    for line in trace.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") != "group" or not t0 <= event.get("sent", 0) <= t1:
            continue
        for rank in event["ranks"]:
            sums["busy s"] += rank["busy"]
            for k, v in rank.get("phases", {}).items():
                sums[k] = sums.get(k, 0.0) + v
    return sums


def figures_line(name: str, f: dict[str, float]) -> str:
    """One row of the decode figures' table."""
    steps = f.get("decode steps", 0.0)
    if not steps:
        return f"| {name} | (no trace) | | | | |\n"
    return (f"| {name} | {steps:,.0f} | {f.get('decode rows', 0.0) / steps:.1f} | "
            f"{f.get('decode s', 0.0):.2f} ({1e3 * f.get('decode s', 0.0) / steps:.2f} ms a step) | "
            f"{f.get('prefill s', 0.0):.2f} | {f.get('busy s', 0.0):.2f} |\n")


def one_round(procs: list[subprocess.Popen], work: Path) -> list[dict]:
    """Every tenant ready, then all go at once; each one's tokens and times."""
    for p in procs:
        if p.stdout.readline().strip() != "ready":
            raise SystemExit(f"a tenant failed before its workload; see {work}/twinkled.log")
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    return [json.loads(p.stdout.readline()) for p in procs]


def keep_log(args: argparse.Namespace, url: str, work: Path) -> None:
    """With `--log`: the daemon's /metrics now and its log so far, copied there (a run cut
    off by its time limit still tells where the time went)."""
    if not args.log:
        return
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            metrics = r.read().decode()
    except OSError as e:
        metrics = f"/metrics: {e}"
    Path(args.log).write_text((work / "twinkled.log").read_text(errors="replace")
                              + "\n--- /metrics ---\n" + metrics)


def engine_alone(args: argparse.Namespace, model: Path, device: str) -> list[dict]:
    """The same requests (every tenant's prompts, each on its own adapter) in one call, in
    two orders: tenant by tenant (the running batch then holds one or two adapters at a
    time) and interleaved, a prompt of each tenant in turn (all of them at once, as the
    daemon's fair share mixes them): the two baselines a round is compared with."""
    import torch

    from twinkled.engine.engine import Engine
    from twinkled.engine.step import HOST_TIME
    from twinkled.protocol.types import LoraConfig, SampleRequest, SamplingParams

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    eng = Engine(model, dtype=dtype, device=torch.device(device), kv_bytes=args.kv_mb << 20)
    params = SamplingParams(max_tokens=args.new, temperature=1.0, stop=[])
    by_tenant = []
    for i in range(args.tenants):
        eng.add_adapter(f"a{i}", LoraConfig(rank=args.rank, seed=i, train_unembed=False))
        by_tenant.append([SampleRequest(f"a{i}", p, params, num_samples=args.samples)
                          for p in prompts_of(args, i)])
    orders = {"tenant by tenant": [r for t in by_tenant for r in t],
              "interleaved": [r for turn in zip(*by_tenant, strict=True) for r in turn]}
    reqs = orders["tenant by tenant"]
    eng.sample([SampleRequest(r.adapter_id, r.prompt[:8], SamplingParams(
        max_tokens=4, temperature=1.0, stop=[]), num_samples=2) for r in reqs[:2]])  # warm-up
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rounds = []
    for _ in range(args.rounds):
        one = {}
        for name, reqs in orders.items():
            sync()
            HOST_TIME.take()
            t0 = time.perf_counter()
            out = eng.sample(reqs)
            sync()
            wall = time.perf_counter() - t0
            one[name] = {"tokens": sum(len(s.tokens) for r in out for s in r.sequences),
                         "wall": wall, "decode": {**HOST_TIME.take(), "busy s": wall}}
        rounds.append(one)
    return rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tenant", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--face", default="tinker", help=argparse.SUPPRESS)
    client_options(ap)
    ap.add_argument("--shape", default="tiny", choices=("tiny", "qwen2.5-0.5b", "qwen3-8b"))
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="the random checkpoint here (reused if there, else written and kept)")
    ap.add_argument("--tenants", type=int, default=8, help="half tinker, half OpenAI")
    ap.add_argument("--prompts", type=int, default=None, help="prompts a tenant (32; CPU 4)")
    ap.add_argument("--samples", type=int, default=8, help="samples a prompt")
    ap.add_argument("--prompt-len", type=int, default=None, help="tokens a prompt (512; CPU 32)")
    ap.add_argument("--new", type=int, default=None, help="new tokens a sample (256; CPU 16)")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--config", type=Path, action="append", default=[],
                    help="the daemon's TOML config; given again, one daemon run per config "
                         "(beside the one engine-alone run)")
    ap.add_argument("--kv-mb", type=int, default=None,
                    help="the sampler's KV pool on both sides, MiB (the daemon's "
                         "sample_kv_mb; GPU 32768, CPU 64): the engine alone would "
                         "otherwise get its 4 GiB default, and fewer rows")
    ap.add_argument("--rounds", type=int, default=2, help="the workload this many times")
    ap.add_argument("--timeout", type=float, default=T, help="seconds the tenants may take")
    ap.add_argument("--log", default=None, help="copy the daemon's log and /metrics here")
    ap.add_argument("--write", default=section_path("sample_daemon"))
    args = ap.parse_args()
    if args.tenant:
        return tenant(args)

    import torch
    from bench_engine import header

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = device == "cuda"
    args.prompts = args.prompts or (32 if gpu else 4)
    args.prompt_len = args.prompt_len or (512 if gpu else 32)
    args.new = args.new or (256 if gpu else 16)
    args.kv_mb = args.kv_mb or (32768 if gpu else 64)
    work = Path(tempfile.mkdtemp(prefix="bench_sample_daemon_"))
    model, args.vocab = model_dir_for(args, work, device)
    try:
        daemons = [through_daemon(args, model, work, device, c) for c in args.config or [None]]
        if gpu:
            torch.cuda.empty_cache()
        alone = engine_alone(args, model, device)
    finally:
        shutil.rmtree(work / "data", ignore_errors=True)
        if args.model_dir is None:
            shutil.rmtree(model, ignore_errors=True)
    rows = ""
    names = [f"through the daemon ({c.name})" for c in args.config] or ["through the daemon"]
    for i, one in enumerate(alone):
        tps = {k: e["tokens"] / e["wall"] for k, e in one.items()}
        base, mixed = tps["tenant by tenant"], tps["interleaved"]
        for name, daemon in zip(names, daemons, strict=True):
            d = daemon[i]
            d_tps = d["tokens"] / d["wall"]
            rows += (f"| {i + 1} | {name} | {d['tokens']:,} | {d['wall']:.2f} | "
                     f"{d_tps:,.0f} | **{d_tps / base:.2f}x** | {d_tps / mixed:.2f}x |\n")
        for k, e in one.items():
            rows += (f"| {i + 1} | engine alone, one call, {k} | {e['tokens']:,} | "
                     f"{e['wall']:.2f} | {tps[k]:,.0f} | {tps[k] / base:.2f}x | "
                     f"{tps[k] / mixed:.2f}x |\n")
    last = daemons[0][-1]
    faces = ", ".join(f"{f} {s:.2f} s" for f, s in zip(last["faces"], last["each"],
                                                          strict=True))
    text = header(device).replace("Engine vs peft", "Sampling through the daemon")
    text += (f"\n### {args.shape} ({device}), {args.tenants} tenants (half tinker, half "
             f"OpenAI), each {args.prompts} prompts x {args.samples} samples, "
             f"{args.prompt_len} + {args.new} tokens, temperature 1, LoRA r={args.rank}, "
             f"a KV pool of {args.kv_mb:,} MiB on both sides\n\n"
             "| round | run | new tokens | seconds | new tok/s | vs engine alone | "
             "vs engine alone, interleaved |\n|---:|---|---:|---:|---:|---:|---:|\n" + rows +
             f"\nEach tenant's seconds, last round: {faces}. The first round of each side "
             "captures the decode's CUDA graphs for the batch's sizes; compare the last.\n"
             "\nThe running batch, last round (the daemon's from its ranks' trace):\n\n"
             "| run | decode steps | rows a step | decode s | prefill s | busy s |\n"
             "|---|---:|---:|---:|---:|---:|\n"
             + "".join(figures_line(name, d[-1]["decode"]) for name, d in zip(
                 names, daemons, strict=True))
             + "".join(figures_line(f"engine alone, {k}", e["decode"])
                       for k, e in alone[-1].items()))
    emit(text, args.write)


if __name__ == "__main__":
    main()
