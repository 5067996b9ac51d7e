"""Many tenants through the daemon, with real tinker clients: throughput and fairness.

A real `twinkled serve` runs on a model of the chosen shape; each tenant is its own process
running the unmodified tinker 0.38 client: per step, forward_backward on a batch of
`--batch` x S random tokens, then optim_step. Measured, in one run:

- 1, 2, 4, 8 tenants at once: aggregate tokens/s and each tenant's p50/p99 step latency
  (forward_backward + optim_step, as the client sees it), against the same work run one
  tenant at a time through the same daemon;
- fairness: a small tenant (1 x S per step) alone, then next to a tenant that floods 10x
  (10 x S per step): the small tenant's p50/p99 latency in both cases.
- with --packed-baseline (GPU): plain transformers + peft packing the same 8 x S tokens
  through one adapter in-process (bench_engine's (c)), the bound the daemon is held to.

    python bench/bench_multitenant.py --shape tiny                 # CPU
    python bench/bench_multitenant.py --shape qwen2.5-0.5b --packed-baseline   # GPU
    python bench/bench_multitenant.py --shape qwen2.5-vl-7b --tenants 1,8 --packed-baseline
        # GPU: each datum 1 image (256 tokens) + S text tokens (bench_vlm.py);
        # --shape qwen3-vl-8b: Qwen3-VL-8B's sizes, 196 image tokens a datum
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from output import section_path  # bench/ is the script's directory

HERE = Path(__file__).resolve().parent


def random_data(args: argparse.Namespace, rng) -> list:
    """`args.batch` datums of `args.seq` random tokens (tinker's types)."""
    import tinker

    if getattr(args, "image_tokens", 0):  # a VL shape: one image + S text tokens a datum
        from bench_vlm import datum

        return [datum(rng, args.vocab, args.seq, args.image_tokens, args.seed)
                for _ in range(args.batch)]
    data = []
    for _ in range(args.batch):
        ids = [rng.randrange(args.vocab) for _ in range(args.seq + 1)]
        data.append(tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
                                       loss_fn_inputs={"target_tokens": ids[1:]}))
    return data


def worker(args: argparse.Namespace) -> None:
    """One tenant: a tinker training loop; prints its step latencies as JSON."""
    import random

    import tinker

    rng = random.Random(args.seed)
    sc = tinker.ServiceClient(base_url=args.url, api_key=args.key)
    tc = sc.create_lora_training_client(base_model=args.base_model, rank=args.rank,
                                        train_unembed=False).result(timeout=600)
    data = random_data(args, rng)
    adam = tinker.types.AdamParams(learning_rate=1e-4)
    for _ in range(args.warmup):
        tc.forward_backward(data, "cross_entropy").result(timeout=600)
        tc.optim_step(adam).result(timeout=600)
    late = max(0.0, time.time() - args.start_at)  # warm-up overran the shared start
    while time.time() < args.start_at:  # all tenants start their timed steps together
        time.sleep(0.001)
    lat = []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        s = time.perf_counter()
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(adam)  # sent before the result, as real loops do
        fb.result(timeout=600)
        opt.result(timeout=600)
        lat.append(time.perf_counter() - s)
    wall = time.perf_counter() - t0
    print(json.dumps({"lat": lat, "wall": wall, "tokens": args.steps * args.batch * args.seq,
                      "late": late,
                      "t0": time.time() - wall, "t1": time.time()}))
    sc.close("success")


def run_tenants(url: str, keys: list[str], model: str, vocab: int, seq: int, steps: int,
                batches: list[int], rank: int = 32, image_tokens: int = 0) -> list[dict]:
    start_at = time.time() + 6 + len(keys)  # time for every client to set up and warm up
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--worker", "--url", url, "--key", key, "--base-model", model,
         "--vocab", str(vocab), "--seq", str(seq), "--steps", str(steps), "--batch", str(b),
         "--seed", str(i), "--start-at", str(start_at), "--rank", str(rank),
         "--image-tokens", str(image_tokens)], stdout=subprocess.PIPE, text=True)
        for i, (key, b) in enumerate(zip(keys, batches, strict=True))]
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=3600)
        if p.returncode != 0:
            raise SystemExit(f"a tenant failed (exit {p.returncode})")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def _free_port() -> int:
    """A port the kernel says is free now: benches run side by side on one machine (one per
    GPU), and a port derived from the pid could collide and answer for the other daemon."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_daemon(model_dir: Path, data: Path, work: Path, device: str,
                 *extra: str, launcher: tuple[str, ...] = (), port: int | None = None
                 ) -> tuple[subprocess.Popen, str, object]:
    """`twinkled serve` on the model; returns once it answers healthz "ok". `launcher`:
    python options that run it under a wrapper, e.g. ("-m", "cProfile", "-o", PATH)."""
    import urllib.request

    port = port or _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(work / "twinkled.log", "ab")  # noqa: SIM115
    daemon = subprocess.Popen(
        [sys.executable, *launcher, "-m", "twinkled", "serve", "--model", str(model_dir),
         "--data-dir",
         str(data), "--port", str(port), "--device", device,
         "--dtype", "bfloat16" if device.startswith("cuda") else "float32", *extra],
        stdout=log, stderr=subprocess.STDOUT)
    for _ in range(1200):
        try:
            with urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=2) as r:
                if json.loads(r.read())["status"] == "ok":
                    break
        except OSError:
            pass
        if daemon.poll() is not None:
            raise SystemExit(f"twinkled exited ({daemon.returncode}); see {work}/twinkled.log")
        time.sleep(0.5)
    return daemon, url, log


def model_dir_for(args: argparse.Namespace, work: Path, device: str) -> tuple[Path, int]:
    """The model's directory and vocabulary: `--model-dir` as it is when it holds a
    checkpoint (an 8B takes minutes to write), else a random one of `--shape` built there."""
    import torch
    from bench_engine import build_model

    path = Path(args.model_dir) if args.model_dir else work / "model"
    if (path / "config.json").exists():
        print(f"reusing the model in {path}", flush=True)
        return path, int(json.loads((path / "config.json").read_text())["vocab_size"])
    print(f"writing a random {args.shape} checkpoint to {path} ...", flush=True)
    t0 = time.time()
    vocab = build_model(args.shape, path, torch.bfloat16 if device == "cuda" else torch.float32,
                        device)
    print(f"  done in {time.time() - t0:.0f} s", flush=True)
    return path, vocab


def make_keys(data: Path, n: int) -> list[str]:
    keys = []
    for i in range(n):
        out = subprocess.run([sys.executable, "-m", "twinkled", "ctl", "--data-dir", str(data),
                              "--create", "keys", "create", "--tenant", f"t{i}"],
                             check=True, capture_output=True, text=True).stdout
        keys.append(out.strip().splitlines()[-1])
    return keys


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def client_options(ap: argparse.ArgumentParser) -> None:
    """What a tinker client process is told: the daemon, its key, the model, its seed."""
    ap.add_argument("--url")
    ap.add_argument("--key")
    ap.add_argument("--base-model")
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--seed", type=int, default=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    client_options(ap)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rank", type=int, default=32, help=argparse.SUPPRESS)
    ap.add_argument("--start-at", type=float, default=0.0)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--shape", default="tiny", choices=("tiny", "qwen2.5-0.5b", "qwen3-8b", "qwen3.5-9b",
                                                         "qwen3.5-35b-a3b", "gpt-oss-20b",
                                                         "deepseek-v3", "qwen2.5-vl-7b",
                                                         "qwen3-vl-8b"))
    ap.add_argument("--image-tokens", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--seq", type=int, default=None, help="tokens per datum (S)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per tenant")
    ap.add_argument("--tenants", default="1,2,4,8")
    ap.add_argument("--packed-baseline", action="store_true")
    ap.add_argument("--skip-fairness", action="store_true",
                    help="leave out the small tenant next to a 10x flooder")
    ap.add_argument("--write", default=section_path("multitenant"))
    ap.add_argument("--config", help="a twinkled TOML config for the daemon")
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    import torch

    sys.path.insert(0, str(HERE))
    from bench_engine import build_model, header

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    seq = args.seq or (512 if device == "cuda" else 64)
    steps = args.steps or (20 if device == "cuda" else 8)
    counts = [int(n) for n in args.tenants.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench_mt_"))
    model_dir = work / "model"
    image_tokens = 0
    if args.shape in ("qwen2.5-vl-7b", "qwen3-vl-8b"):  # (bench_vlm.py)
        from bench_vlm import build

        vocab, image_tokens = build(model_dir, dtype, device, args.shape)
    else:
        vocab = build_model(args.shape, model_dir, dtype, device)
    data = work / "data"
    keys = make_keys(data, max(counts))
    daemon, url, log = start_daemon(model_dir, data, work, device,
                                    *(["--config", args.config] if args.config else []))
    rows = []
    try:
        name = model_dir.name
        # Every tenant does the same work, so one at a time runs at one tenant's alone rate.
        alone = run_tenants(url, keys[:1], name, vocab, seq, steps, [1],
                            image_tokens=image_tokens)[0]
        one_by_one = alone["tokens"] / alone["wall"]
        for n in counts:
            res = run_tenants(url, keys[:n], name, vocab, seq, steps, [1] * n,
                              image_tokens=image_tokens)
            wall = max(r["t1"] for r in res) - min(r["t0"] for r in res)
            together = sum(r["tokens"] for r in res) / wall
            lat = [x for r in res for x in r["lat"]]
            rows.append((f"{n} tenant(s), 1x{seq} each", together, one_by_one,
                         pct(lat, 0.5), pct(lat, 0.99)))
        small_alone, small_next = alone["lat"], None
        if not args.skip_fairness:
            mixed = run_tenants(url, keys[:2], name, vocab, seq, steps, [1, 10],
                                image_tokens=image_tokens)
            small_next = mixed[0]["lat"]
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)
        log.close()

    text = header(device).replace("Engine vs peft", "Multi-tenant through the daemon")
    config = f", config `{Path(args.config).read_text().strip()}`" if args.config else ""
    depth = " (its first 12 layers)" if args.shape == "qwen3.5-35b-a3b" else ""  # (MOE_LAYERS)
    text += (f"\n### {args.shape}{depth} ({device}{config}, {str(dtype).split('.')[-1]}, LoRA r=32 on all "
             f"linear layers, S={seq}, {steps} timed steps per tenant, unmodified tinker 0.38 "
             f"clients, one process each)\n\n"
             "| tenants | together (tok/s) | one at a time (tok/s) | ratio | step p50 (s) "
             "| step p99 (s) |\n|---|---:|---:|---:|---:|---:|\n")
    for label, tog, seqr, p50, p99 in rows:
        text += f"| {label} | {tog:,.0f} | {seqr:,.0f} | {tog / seqr:.2f} | {p50:.3f} | {p99:.3f} |\n"
    a50, a99 = pct(small_alone, 0.5), pct(small_alone, 0.99)
    n50, n99 = (pct(small_next, 0.5), pct(small_next, 0.99)) if small_next else (a50, a99)
    text += "" if small_next is None else ("\nFairness: a small tenant (1 x S per step) alone, then next to a tenant sending "
             "10 x S per step.\n\n| small tenant | step p50 (s) | step p99 (s) |\n|---|---:|---:|\n"
             f"| alone | {a50:.3f} | {a99:.3f} |\n| next to the 10x flooder | {n50:.3f} | "
             f"{n99:.3f} |\n| ratio (target p99 <= 2x) | {n50 / a50:.2f} | {n99 / a99:.2f} |\n")
    print(text, flush=True)  # (the daemon's figures, before a baseline that may fail)
    if args.packed_baseline:
        from bench_engine import GPU_SIZES, bench_peft, free

        free(device)
        if image_tokens:  # text tokens/s of 8 datums of 1 image + S tokens, one batch
            from bench_vlm import peft_baseline

            packed_tps = peft_baseline(model_dir, dtype, device, seq)
        else:
            seed_train = [torch.randint(0, vocab, (seq + 1,)) for _ in range(8)]
            peft_rows = bench_peft(model_dir, dtype, device, GPU_SIZES, seed_train, None,
                                   packed_only=True)
            packed = next(r for r in peft_rows if r.test.startswith("(c)"))
            packed_tps = packed.tokens / packed.seconds
        eight = next((r for r in rows if r[0].startswith("8 ")), None)
        bound = (f"\nIn-process bound, same run: plain peft packing 8 x {seq} tokens through "
                 f"one adapter: {packed_tps:,.0f} tok/s.")
        if eight:
            bound += f" 8 tenants through the daemon reach **{eight[1] / packed_tps:.2f}x** of it (target >= 0.75)."
        text += bound + "\n"
        print(bound)
    if args.write:
        path = Path(args.write)
        with path.open("a") as f:
            f.write("\n" + text)
        print(f"appended to {path}")


if __name__ == "__main__":
    main()
