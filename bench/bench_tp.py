"""Tensor parallelism: LoRA training tokens/s, MFU and peak memory per GPU at tp = 1, 2, ...

Random-weight checkpoints of real shapes (written tensor by tensor, so a 32B model never
sits whole in memory), one engine replica split over `tp` GPUs (one process per GPU,
NCCL), `--adapters` adapters co-batched, each with one row of `--seq` tokens per step
(forward_backward + optim_step). MFU counts 4N FLOPs per trained token (forward 2N,
backward through the frozen base 2N; attention and LoRA left out, recomputation not
counted as useful work) against the card's dense bf16 peak.

    python bench/bench_tp.py --shape qwen3-8b --tp 1,2          # 1 GPU, then 2
    python bench/bench_tp.py --shape qwen3-32b --tp 2
    python bench/bench_tp.py --shape tiny --tp 1,2 --device cpu # CPU, gloo (a smoke run)

With `--daemon`, the same work goes through a real `twinkled serve --tp N` on N GPUs, driven
by `--adapters` tenants each running the unmodified tinker client (bench_multitenant's
tenants, 1 x `--seq` tokens per step): tokens/s as the clients see it, and each rank's
peak memory from `twinkled ctl status`.

    python bench/bench_tp.py --shape qwen3-32b --tp 2 --daemon
    python bench/bench_tp.py --shape llama3-70b --tp 4 --daemon

With `--sample`, RL fan-out sampling on the engine alone at each tp: the running batch
against the padded sampler, the same requests in the same run.

    python bench/bench_tp.py --shape qwen3-8b --tp 1,2 --sample
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
SHAPES = {  # config.json numbers of the Qwen3 family (vocab 151936)
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8),
    "qwen3-14b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                      num_attention_heads=40, num_key_value_heads=8),
    "qwen3-32b": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                      num_attention_heads=64, num_key_value_heads=8),
    # Llama-3.3-70B's widths and depth in the Qwen3 layout (q/k norms; Qwen3's vocabulary)
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8),
}
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def write_random_checkpoint(shape: str, out: Path) -> None:
    """A Qwen3 checkpoint of `shape` with random bf16 weights, one safetensors file per
    layer, generated on a GPU when there is one."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen3Config

    from twinkled.engine.tiny import build_tiny_model, build_tokenizer

    if shape == "tiny":
        build_tiny_model(out, num_heads=4, num_kv_heads=2)
        return
    cfg = Qwen3Config(head_dim=128, tie_word_embeddings=False, max_position_embeddings=40960,
                      vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6, **SHAPES[shape])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(dev).manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)
    parts: dict[str, list] = {}  # file -> [(name, shape)]: a layer per file, then the rest
    for name, p in model.named_parameters():
        part = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        parts.setdefault(f"model-{part}.safetensors", []).append((name, p.shape))
    for file, params in parts.items():
        tensors = {name: (torch.ones(shape, dtype=torch.bfloat16) if "norm" in name else
                          (torch.randn(shape, device=dev, generator=gen, dtype=torch.bfloat16)
                           * 0.02).cpu()) for name, shape in params}
        save_file(tensors, out / file, metadata={"format": "pt"})
    files = {file: [name for name, _ in params] for file, params in parts.items()}
    wmap = {name: f for f, names in files.items() for name in names}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {},
                                                                  "weight_map": wmap}))
    cfg.save_pretrained(out)
    build_tokenizer(out)


def worker(args: dict) -> None:
    """One rank: an engine replica's share; rank 0 prints one JSON line."""
    import torch
    import torch.distributed as dist

    from twinkled.engine.engine import Engine
    from twinkled.protocol.sizing import weight_bytes
    from twinkled.protocol.types import AdamParams, Datum, ForwardBackwardRequest, LoraConfig

    rank, world, tp = args["rank"], args["world"], args["tp"]
    cuda = args["device"] == "cuda"
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=args["url"], rank=rank,
                            world_size=world)
    tpc = None
    if tp > 1:
        from twinkled.engine.tp import TensorParallel

        tpc = TensorParallel(tp)
    dtype = "bfloat16" if cuda else "float32"
    eng = Engine(args["model"], dtype=dtype, device=device, max_rank=args["rank_lora"],
                 token_budget=args["token_budget"], tp=tpc, recompute=args["recompute"],
                 dp_group=None if tpc is None else tpc.dp_group)
    names = [f"a{i}" for i in range(args["adapters"])]
    for i, n in enumerate(names):
        eng.add_adapter(n, LoraConfig(rank=args["rank_lora"], alpha=32, seed=i))
    if args.get("sample"):
        return sample_worker(eng, names, args)
    gen = torch.Generator().manual_seed(0)
    vocab, seq = eng.model.vocab_size, args["seq"]
    reqs = []
    for n in names:
        x = torch.randint(0, vocab, (seq + 1,), generator=gen)
        reqs.append(ForwardBackwardRequest(n, [Datum(x[:-1], {"target_tokens": x[1:],
                                                              "weights": torch.ones(seq)})]))
    adam = [(n, AdamParams(learning_rate=1e-4)) for n in names]

    def step():
        eng.forward_backward(reqs, checked=True)
        eng.optim_steps(adam)
        if cuda:
            torch.cuda.synchronize()

    for _ in range(args["warmup"]):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args["steps"]):
        step()
    seconds = (time.perf_counter() - t0) / args["steps"]
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    if rank == 0:
        n_params = weight_bytes(eng.model.config.to_dict(), 1, 1)  # bytes at 1 B each = N
        tokens = seq * len(names)
        print("RESULT " + json.dumps({
            "tp": tp, "gpus": world, "tokens": tokens, "step_s": seconds,
            "tok_s": tokens / seconds, "flops_per_token": 4 * n_params,
            "peak_gib": [p / 2**30 for p in peaks],
            "recomputed": eng.model.recompute.used > 0,
            "card": torch.cuda.get_device_name(0) if cuda else "cpu"}), flush=True)
    dist.destroy_process_group()


def sample_worker(eng, names: list[str], args: dict) -> None:
    """RL fan-out sampling on this rank's share: `--prompts` prompts of `--seq` tokens x
    `--samples` samples of `--new-tokens` tokens at T=1, the adapters in turn, through the
    running batch and then the padded sampler (`Engine.padded_sampling`, what tensor-parallel
    groups sampled with before): new tokens/s of each, the same requests."""
    import torch
    import torch.distributed as dist

    from twinkled.protocol.types import SampleRequest, SamplingParams

    gen = torch.Generator().manual_seed(0)
    vocab = eng.model.vocab_size
    reqs = [SampleRequest(names[i % len(names)],
                          torch.randint(0, vocab, (args["seq"],), generator=gen).tolist(),
                          SamplingParams(max_tokens=args["new_tokens"], temperature=1.0,
                                         seed=i, stop=[]),
                          num_samples=args["samples"]) for i in range(args["prompts"])]
    from twinkled.engine.running import RunningBatch
    from twinkled.engine.sampler import generate

    cuda = eng.model.device.type == "cuda"
    adapters = [eng.pool.get(r.adapter_id) for r in reqs]
    # "graphs": a running batch whose decode steps are CUDA graphs with the group's
    # collectives captured in them (on trial: the engine decodes eagerly under tp)
    graphs = RunningBatch(eng.model, decode="graphs", overlap=False) if cuda else None

    def sample(path: str, some: list):
        eng.padded_sampling = path == "padded"
        if path == "graphs":
            return generate(eng.model, some, adapters[:len(some)], batch=graphs)
        return eng.sample(some)

    out = {}
    for path in ("running", "padded", "graphs")[:3 if cuda else 2]:
        sample(path, reqs[:1])  # warm-up (kernels, the pool, the graphs)
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        res = sample(path, reqs)
        if cuda:
            torch.cuda.synchronize()
        new = sum(len(q.tokens) for r in res for q in r.sequences)
        out[path] = new / (time.perf_counter() - t0)
        if dist.get_rank() == 0:  # after each path: a later one that hangs loses nothing
            print(f"PATH {path} {out[path]:.0f} new tok/s", flush=True)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"tp": args["tp"], "gpus": args["world"], "sample": out,
                                      "card": torch.cuda.get_device_name(0) if cuda else "cpu"}),
              flush=True)
    dist.destroy_process_group()


def run_config(model: Path, tp: int, a) -> dict | None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = {"model": str(model), "world": tp, "tp": tp, "device": a.device,
              "url": f"tcp://127.0.0.1:{port}", "adapters": a.adapters, "seq": a.seq,
              "rank_lora": a.lora_rank, "token_budget": a.token_budget, "steps": a.steps,
              "warmup": a.warmup, "recompute": a.recompute, "sample": a.sample,
              "prompts": a.prompts, "samples": a.samples, "new_tokens": a.new_tokens}
    path = os.pathsep.join(p for p in (str(HERE.parent), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, TOKENIZERS_PARALLELISM="false")
    procs = [subprocess.Popen([sys.executable, __file__, "--worker",
                               json.dumps({**common, "rank": r})], env=env,
                              stdout=subprocess.PIPE, text=True) for r in range(tp)]
    result = None
    for p in procs:
        for line in p.stdout:  # (as they come: a rank that hangs later loses none of them)
            if line.startswith("RESULT "):
                result = json.loads(line[7:])
            elif line.startswith("PATH "):
                print(line.rstrip(), flush=True)
        p.wait()
    if any(p.returncode for p in procs):
        print(f"tp={tp}: a rank failed (exit codes {[p.returncode for p in procs]})")
    return result


def run_daemon(model: Path, tp: int, a) -> dict | None:
    """`--adapters` tinker tenants against `twinkled serve --tp tp` on the first tp devices."""
    from bench_multitenant import make_keys, run_tenants, start_daemon
    from bench_workers import path_report, planner_report
    from transformers import AutoConfig

    from twinkled.protocol.sizing import weight_bytes

    cfg = AutoConfig.from_pretrained(model)
    work = Path(tempfile.mkdtemp(prefix=f"bench_tp{tp}_"))
    conf = work / "twinkled.toml"
    conf.write_text(f"persist_every = 0\nmax_rank = {a.lora_rank}\n"
                    f"token_budget = {a.token_budget}\n"
                    f'activation_checkpointing = "{a.recompute}"\n')
    cuda = a.device == "cuda"
    devices = ",".join(f"cuda:{i}" if cuda else "cpu" for i in range(tp))
    data = work / "data"
    keys = make_keys(data, a.adapters)
    traced = work / "trace.jsonl"
    if a.trace:
        os.environ["TWINKLED_TRACE"] = str(traced)
    try:
        daemon, url, log = start_daemon(model, data, work, devices.split(",")[0], "--devices",
                                        devices, "--tp", str(tp), "--config", str(conf))
    except SystemExit as e:
        print(f"tp={tp}: {e}")
        print((work / "twinkled.log").read_text()[-2000:])
        return None
    try:
        res = run_tenants(url, keys, model.name, cfg.vocab_size, a.seq, a.steps,
                          [1] * a.adapters, rank=a.lora_rank)
        planner_report(data)  # how many steps a round took, the step target, the fitted cost
        path_report(url)  # the daemon's step time, each rank's busy time, the gather wait
        if a.trace:  # the timed window: up to 2 steps a round
            subprocess.run([sys.executable, str(HERE / "trace_report.py"), str(traced),
                            "--last", str(2 * a.steps)], check=False)
        status = json.loads(subprocess.run(
            [sys.executable, "-m", "twinkled", "ctl", "--data-dir", str(data), "status",
             "--json"], capture_output=True, text=True).stdout)
    except (SystemExit, ValueError) as e:
        print(f"tp={tp}: {e}")
        print((work / "twinkled.log").read_text()[-2000:])
        return None
    finally:
        daemon.terminate()
        daemon.wait(timeout=300)
        log.close()
    for line in (work / "twinkled.log").read_text(errors="replace").splitlines():
        if "allocator retried" in line or "fell back" in line:  # the workers' warnings
            print(line)
    wall = max(r["t1"] for r in res) - min(r["t0"] for r in res)
    tokens = sum(r["tokens"] for r in res)
    import torch

    return {"tp": tp, "gpus": tp, "tok_s": tokens / wall,
            "flops_per_token": 4 * weight_bytes(cfg.to_dict(), 1, 1),
            "peak_gib": [w.get("peak_memory_bytes", 0) / 2**30 for w in status["workers"]],
            "recomputed": None,
            "card": torch.cuda.get_device_name(0) if cuda else "cpu"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b", choices=[*SHAPES, "tiny"])
    ap.add_argument("--tp", default="1,2", help="tensor-parallel sizes to run, one after another")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--token-budget", type=int, default=16384)
    ap.add_argument("--recompute", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--model-dir", type=Path, help="reuse (or keep) the random checkpoint here")
    ap.add_argument("--daemon", action="store_true",
                    help="through twinkled serve --tp N and tinker clients, not the engine")
    ap.add_argument("--trace", action="store_true",
                    help="with --daemon: trace its steps (TWINKLED_TRACE) and print the report")
    ap.add_argument("--peft", action="store_true",
                    help="also plain transformers + peft over the largest tp's GPUs "
                         "(device_map=auto, tenants one at a time)")
    ap.add_argument("--prepare-only", action="store_true",
                    help="write the random checkpoint into --model-dir and stop")
    ap.add_argument("--sample", action="store_true",
                    help="RL fan-out sampling instead of training: the running batch against "
                    "the padded sampler, the same requests (engine alone, CUDA)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(json.loads(a.worker))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model_dir or Path(tmp) / a.shape
        if not (model / "config.json").is_file():
            model.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            write_random_checkpoint(a.shape, model)
            print(f"wrote a random {a.shape} checkpoint in {time.perf_counter() - t0:.0f} s")
        if a.prepare_only:
            return
        if a.sample:
            print(f"{a.shape}: {a.prompts} prompts of {a.seq} tokens x {a.samples} samples x "
                  f"{a.new_tokens} new tokens, T=1, {a.adapters} adapters r={a.lora_rank}")
            print("| tp | GPUs | running batch new tok/s | padded sampler new tok/s | ratio | "
                  "running batch, CUDA graphs |")
            print("|---:|---:|---:|---:|---:|---:|")
            for tp in (int(t) for t in a.tp.split(",")):
                r = run_config(model, tp, a)
                s = (r or {}).get("sample", {})
                if not s:
                    print(f"| {tp} | {tp} | failed | | |", flush=True)
                    continue
                g = f"{s['graphs']:,.0f}" if "graphs" in s else "-"
                print(f"| {tp} | {tp} | {s['running']:,.0f} | {s['padded']:,.0f} | "
                      f"{s['running'] / s['padded']:.2f}x | {g} |", flush=True)
            return
        print(f"{a.shape}: {a.adapters} adapters x {a.seq} tokens per step, LoRA r={a.lora_rank} "
              f"on every module, recompute={a.recompute}, "
              f"{'through the daemon' if a.daemon else 'the engine alone'}")
        print("| tp | GPUs | tokens/s | tokens/s per GPU | MFU | peak GiB per GPU | recomputed |")
        print("|---:|---:|---:|---:|---:|---|---|")
        for tp in (int(t) for t in a.tp.split(",")):
            r = run_daemon(model, tp, a) if a.daemon else run_config(model, tp, a)
            print_row(str(tp), r)
        if a.peft and a.device == "cuda":
            print_row("peft", run_peft(model, max(int(t) for t in a.tp.split(",")), a))


def print_row(label: str, r: dict | None) -> None:
    if r is None:
        print(f"| {label} | | failed | | | | |", flush=True)
        return
    peak = next((v for k, v in PEAK_BF16.items() if k in r["card"]), None)
    mfu = f"{r['tok_s'] * r['flops_per_token'] / (peak * r['gpus']):.1%}" if peak else "-"
    print(f"| {label} | {r['gpus']} | {r['tok_s']:,.0f} | {r['tok_s'] / r['gpus']:,.0f} | "
          f"{mfu} | {', '.join(f'{g:.1f}' for g in r['peak_gib'])} | "
          f"{ {True: 'yes', False: 'no'}.get(r['recomputed'], '-')} |", flush=True)


def run_peft(model: Path, gpus: int, a) -> dict | None:
    """Plain transformers + peft over `gpus` cards (bench/peft_baseline.py), gradient
    checkpointing on as a user of a model this size would have it."""
    import torch
    from peft_baseline import DENSE, peft_run
    from transformers import AutoConfig

    from twinkled.protocol.sizing import weight_bytes

    try:
        tps, peaks = peft_run(model, a.adapters, a.seq, a.steps, a.lora_rank, DENSE,
                              gpus=gpus, checkpointing=True)
    except Exception as e:  # noqa: BLE001 - the baseline failing must not lose our rows
        print(f"peft: {type(e).__name__}: {str(e)[:200]}")
        return None
    return {"tp": 0, "gpus": gpus, "tok_s": tps, "peak_gib": peaks, "recomputed": True,
            "flops_per_token": 4 * weight_bytes(AutoConfig.from_pretrained(model).to_dict(), 1, 1),
            "card": torch.cuda.get_device_name(0)}


if __name__ == "__main__":
    main()
