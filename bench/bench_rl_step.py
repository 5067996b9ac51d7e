"""An RL step as tinker-cookbook's `rl_loop` runs it, through a real daemon: seconds per step,
split into sampling, training and the rest.

A real `twinkled serve` runs a random-weight model of the chosen shape; each tenant is its
own process running the unmodified tinker 0.38 client through the cookbook 0.6.1
`rl_loop` shape, per step:

1. `save_weights_and_get_sampling_client()` (the current weights);
2. one `sample` call per prompt, all sent at once: `--prompts` (P) random-token prompts
   of `--prompt-len` tokens, `--group` (G) samples each, `--new-tokens` new tokens,
   temperature 1 (no stop: every sample runs to its length);
3. a Datum per sample (prompt + completion, `target_tokens`, the sampler's `logprobs`, a
   random reward centred within its group as the `advantages`), then, as the cookbook
   does, one `forward_backward` of all P x G datums with the `importance_sampling` loss (one
   of the cookbook's choices; its default, `stable_reinforce`, also records the sampled
   sequences) and one `optim_step` (AdamW, lr 4e-5, betas 0.9 / 0.95), sent back to back.

Reported per step: sampling seconds (2), training seconds (3's forward_backward +
optim_step), other (1, and building the datums), new tokens/s of sampling, trained
tokens/s, and the prompt tokens the sampler reports as cached (`prompt_cache_hit_tokens`).
`--warmup` steps run first (CUDA graphs, compilation), then `--steps` timed ones, every
tenant's timed steps starting together.

    python bench/bench_rl_step.py --prompts 4 --group 4 --prompt-len 32 --new-tokens 16
                                               # CPU, the tiny model: about a minute
    python bench/bench_rl_step.py --shape qwen3-8b --sample-kv-mb 12288 --model-dir /tmp/q8b \
        --warmup 0 --steps 1                   # GPU: the cookbook default, 128 x 16, 512 + 256
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from pathlib import Path

from bench_multitenant import model_dir_for
from output import emit, section_path  # bench/ is the script's directory

HERE = Path(__file__).resolve().parent
T = 3600  # seconds any one client call may take (an 8B cookbook step takes minutes)
TAG = "RLSTEP "  # the tenant's result lines on stdout


# -- a tenant: the cookbook loop through the tinker client -------------------------------

def datums(tinker, prompt: list[int], seqs, rewards: list[float]) -> list:
    """The cookbook's Datums for one group: its model input is the prompt and all but the
    last sampled token, its targets the same shifted by one (zeros over the prompt)."""
    import numpy as np

    TensorData = tinker.types.TensorData
    mean = sum(rewards) / len(rewards)
    ob = len(prompt) - 1
    out = []
    for s, r in zip(seqs, rewards, strict=True):
        toks = list(s.tokens)
        n = ob + len(toks)
        out.append(tinker.types.Datum(
            model_input=tinker.types.ModelInput.from_ints(prompt + toks[:-1]),
            loss_fn_inputs={
                "target_tokens": TensorData.from_numpy(np.array([0] * ob + toks, np.int64)),
                "logprobs": TensorData.from_numpy(
                    np.array([0.0] * ob + list(s.logprobs), np.float32)),
                "advantages": TensorData.from_numpy(
                    np.concatenate([np.zeros(ob, np.float32),
                                    np.full(n - ob, r - mean, np.float32)]))}))
    return out


def progress(args, what: str) -> None:
    """A line for the person watching a long step (stderr: the parent passes it through)."""
    print(f"[tenant {args.index}] {what}", file=sys.stderr, flush=True)


def rl_step(tinker, tc, adam, rng: random.Random, args) -> dict:
    """One cookbook RL step; returns its timings and token counts."""
    prompts = [[rng.randrange(args.vocab) for _ in range(args.prompt_len)]
               for _ in range(args.prompts)]
    params = tinker.types.SamplingParams(max_tokens=args.new_tokens, temperature=1.0, stop=[])
    t0 = time.perf_counter()
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=T)
    t1 = time.perf_counter()
    futures = [sampler.sample(tinker.types.ModelInput.from_ints(p), args.group, params)
               for p in prompts]
    results = []
    for f in futures:
        results.append(f.result(timeout=T))
        if len(results) % max(1, len(futures) // 4) == 0 and time.perf_counter() - t1 > 10:
            progress(args, f"sampling: {len(results)}/{len(futures)} prompts done, "
                           f"{time.perf_counter() - t1:.0f} s")
    t2 = time.perf_counter()
    data = []
    for p, res in zip(prompts, results, strict=True):
        data += datums(tinker, p, res.sequences, [rng.random() for _ in res.sequences])
    t3 = time.perf_counter()
    if t3 - t0 > 10:
        progress(args, f"training on {len(data):,} datums ...")
    fb = tc.forward_backward(data, "importance_sampling")
    opt = tc.optim_step(adam)  # sent before the result, as the cookbook does
    fb.result(timeout=T)
    opt.result(timeout=T)
    t4 = time.perf_counter()
    new = sum(len(s.tokens) for r in results for s in r.sequences)
    return {"sample_s": t2 - t1, "train_s": t4 - t3, "other_s": (t1 - t0) + (t3 - t2),
            "total_s": t4 - t0, "new_tokens": new,
            "train_tokens": sum(d.model_input.length for d in data),
            "samples": sum(len(r.sequences) for r in results),
            "cached": sum(getattr(r, "prompt_cache_hit_tokens", 0) or 0 for r in results)}


def loop(args: argparse.Namespace) -> None:
    """One tenant: warm-up steps, then (once `--go` exists) the timed steps; one result
    line per step on stdout."""
    import tinker

    rng = random.Random(args.seed)
    sc = tinker.ServiceClient(base_url=args.url, api_key=args.key)
    tc = sc.create_lora_training_client(base_model=args.base_model, rank=args.rank,
                                        seed=args.seed, train_unembed=args.unembed
                                        ).result(timeout=T)
    adam = tinker.types.AdamParams(learning_rate=4e-5, beta1=0.9, beta2=0.95, eps=1e-8)
    for i in range(args.warmup + args.steps):
        if i == args.warmup:  # every tenant starts its timed steps together
            Path(args.ready).write_text("")
            while not os.path.exists(args.go):
                time.sleep(0.05)
        out = rl_step(tinker, tc, adam, rng, args)
        warm = i < args.warmup
        out.update(step=i if warm else i - args.warmup, warm=warm, t_end=time.time())
        print(TAG + json.dumps(out), flush=True)
    sc.close("success")


# -- the parent: model, daemon, tenants, table ---------------------------------------------

def daemon_config(args, work: Path) -> Path:
    """The daemon's TOML: `--config`'s keys, plus `--sample-kv-mb` where given."""
    text = Path(args.config).read_text() if args.config else ""
    if args.sample_kv_mb is not None:
        if "sample_kv_mb" in tomllib.loads(text):
            raise SystemExit("--sample-kv-mb and --config both set sample_kv_mb: give one")
        text += f"\nsample_kv_mb = {args.sample_kv_mb}\n"
    tomllib.loads(text)  # a bad file fails here, not in the daemon
    path = work / "twinkled.toml"
    path.write_text(text)
    return path


def tenant_cmd(args, i: int, url: str, key: str, model: str, vocab: int, work: Path) -> list:
    return [sys.executable, __file__, "--loop", "--url", url, "--key", key, "--base-model",
            model, "--vocab", str(vocab), "--index", str(i), "--seed", str(1000 + i), "--prompts",
            str(args.prompts), "--group", str(args.group), "--prompt-len", str(args.prompt_len),
            "--new-tokens", str(args.new_tokens), "--steps", str(args.steps), "--warmup",
            str(args.warmup), "--rank", str(args.rank), "--ready", str(work / f"ready{i}"),
            "--go", str(work / "go")] + ([] if args.unembed else ["--no-unembed"])


def run_tenants(args, url: str, keys: list[str], model: str, vocab: int, work: Path,
                daemon, steps: list[list[dict]], on_step) -> None:
    """Start the tenants, print each step as it ends (into `steps[tenant]`, then
    `on_step()`), start the timed steps together."""
    procs = [subprocess.Popen(tenant_cmd(args, i, url, k, model, vocab, work),
                              stdout=subprocess.PIPE, text=True) for i, k in enumerate(keys)]
    lock = threading.Lock()

    def read(i: int, p) -> None:
        for line in p.stdout:
            if not line.startswith(TAG):
                print(f"[tenant {i}] {line.rstrip()}", flush=True)
                continue
            r = json.loads(line[len(TAG):])
            with lock:
                steps[i].append(r)
                on_step()
            print(f"[tenant {i}] {'warm-up' if r['warm'] else 'timed'} step {r['step']}: "
                  f"sample {r['sample_s']:.1f} s, train {r['train_s']:.1f} s, other "
                  f"{r['other_s']:.1f} s ({r['new_tokens']:,} new, {r['train_tokens']:,} "
                  f"trained tokens)", flush=True)

    readers = [threading.Thread(target=read, args=(i, p), daemon=True)
               for i, p in enumerate(procs)]
    for t in readers:
        t.start()
    try:
        while not all((work / f"ready{i}").exists() for i in range(len(procs))):
            for i, p in enumerate(procs):
                if p.poll() is not None:
                    raise SystemExit(f"tenant {i} exited ({p.returncode}) before its timed steps")
            if daemon.poll() is not None:
                raise SystemExit(f"twinkled exited ({daemon.returncode})")
            time.sleep(0.2)
        print(f"all {len(procs)} tenant(s) warmed up; timed steps start", flush=True)
        (work / "go").write_text("")
        while any(p.poll() is None for p in procs):
            if daemon.poll() is not None:
                raise SystemExit(f"twinkled exited ({daemon.returncode}) during the steps")
            time.sleep(0.5)
        for i, p in enumerate(procs):
            if p.returncode != 0:
                raise SystemExit(f"tenant {i} failed (exit {p.returncode})")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for t in readers:
        t.join(timeout=10)


def healthy(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=10) as r:
            return json.loads(r.read())["status"] == "ok"
    except OSError:
        return False


def commit(tree: Path) -> str:
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip() or "?"


def versions(daemon_src: str | None) -> str:
    from importlib.metadata import version

    src = (f"twinkled from {daemon_src} (commit {commit(Path(daemon_src))}), bench at commit "
           if daemon_src else "twinkle commit ")
    return f"tinker {version('tinker')}, {src}{commit(HERE)}"


def use_daemon_src(src: str | None) -> None:
    """Run twinkled (and its ctl) from another source tree, e.g. an older commit's: `python
    -m` looks in the working directory first, then PYTHONPATH, so both point there."""
    if not src:
        return
    root = Path(src).resolve()
    if not (root / "twinkled" / "__main__.py").exists():
        raise SystemExit(f"--daemon-src {src}: no twinkled package there")
    os.environ["PYTHONPATH"] = str(root)
    os.chdir(root)


def report(args, steps: list[list[dict]], device: str, config: Path) -> str:
    from bench_engine import header

    text = header(device).replace("Engine vs peft", "RL step (tinker-cookbook rl_loop shape)")
    text += f"- {versions(args.daemon_src)}\n"
    conf = " ".join(line.strip() for line in config.read_text().splitlines() if line.strip())
    text += (f"\n### {args.shape} ({device}), {args.tenants} tenant(s), each: {args.prompts} "
             f"prompts x {args.group} samples, {args.prompt_len} + {args.new_tokens} tokens, "
             f"temperature 1, importance_sampling, LoRA r={args.rank}"
             f"{'' if args.unembed else ' (no unembed)'}, {args.warmup} warm-up + "
             f"{args.steps} timed step(s); daemon config `{conf or 'defaults'}`\n\n"
             "| tenant | step | sample s | train s | other s | new tok/s | train tok/s | "
             "total s | prompt tokens cached |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|\n")
    for i, rows in enumerate(steps):
        for r in rows:
            label = f"warm-up {r['step']}" if r["warm"] else str(r["step"])
            text += (f"| {i} | {label} | {r['sample_s']:.2f} | {r['train_s']:.2f} | "
                     f"{r['other_s']:.2f} | {r['new_tokens'] / r['sample_s']:,.0f} | "
                     f"{r['train_tokens'] / r['train_s']:,.0f} | {r['total_s']:.2f} | "
                     f"{r['cached']:,} |\n")
    timed = [r for rows in steps for r in rows if not r["warm"]]
    if timed:
        def mean(k: str) -> float:
            return sum(r[k] for r in timed) / len(timed)

        text += (f"| mean | timed | **{mean('sample_s'):.2f}** | **{mean('train_s'):.2f}** | "
                 f"{mean('other_s'):.2f} | {mean('new_tokens') / mean('sample_s'):,.0f} | "
                 f"{mean('train_tokens') / mean('train_s'):,.0f} | **{mean('total_s'):.2f}** | "
                 f"{mean('cached'):,.0f} |\n")
        start = min(r["t_end"] - r["total_s"] for r in timed)
        wall = max(r["t_end"] for r in timed) - start
        text += (f"\nAll tenants' timed steps, sampling and training together: {wall:.1f} s "
                 f"wall, {sum(r['new_tokens'] for r in timed) / wall:,.0f} new and "
                 f"{sum(r['train_tokens'] for r in timed) / wall:,.0f} trained tok/s over it; "
                 f"samples ran to {mean('new_tokens') / mean('samples'):.1f} new tokens on "
                 "average.\n")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loop", action="store_true", help=argparse.SUPPRESS)
    for opt in ("--url", "--key", "--base-model", "--ready", "--go"):
        ap.add_argument(opt, help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--shape", default="tiny", choices=("tiny", "qwen2.5-0.5b", "qwen3-8b"))
    ap.add_argument("--prompts", type=int, default=128, help="prompts per step (P)")
    ap.add_argument("--group", type=int, default=16, help="samples per prompt (G)")
    ap.add_argument("--prompt-len", type=int, default=512, help="tokens per prompt")
    ap.add_argument("--new-tokens", type=int, default=256, help="new tokens per sample")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per tenant")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first, per tenant")
    ap.add_argument("--tenants", type=int, default=1,
                    help="independent tenants, each running the loop at once")
    ap.add_argument("--rank", type=int, default=32, help="LoRA rank (the cookbook's 32)")
    ap.add_argument("--no-unembed", dest="unembed", action="store_false",
                    help="no LoRA on the unembedding (tinker's default trains it)")
    ap.add_argument("--config", help="a twinkled TOML config file for the daemon")
    ap.add_argument("--sample-kv-mb", type=int, default=None,
                    help="the daemon's sample_kv_mb (sampler KV pool per worker, MiB)")
    ap.add_argument("--model-dir", type=lambda p: str(Path(p).resolve()),
                    help="use the checkpoint here, or write the random one here to reuse "
                    "next time (default: a temporary directory)")
    ap.add_argument("--daemon-src", help="run twinkled from this source tree (e.g. a checkout "
                    "of an older commit, for a before/after on the same card)")
    ap.add_argument("--write", default=section_path("rl_step"),  # rewritten after each step
                    type=lambda p: p and str(Path(p).resolve()),
                    help="write the section to PATH ('' to skip)")
    args = ap.parse_args()
    if args.loop:
        return loop(args)
    if min(args.prompts, args.group, args.prompt_len, args.new_tokens, args.steps,
           args.tenants, args.rank) < 1 or args.warmup < 0:
        raise SystemExit("--prompts, --group, --prompt-len, --new-tokens, --steps, --tenants "
                         "and --rank must be >= 1, --warmup >= 0")

    import torch

    sys.path.insert(0, str(HERE))
    from bench_multitenant import make_keys, start_daemon

    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = Path(tempfile.mkdtemp(prefix="bench_rl_"))
    config = daemon_config(args, work)
    model_dir, vocab = model_dir_for(args, work, device)
    use_daemon_src(args.daemon_src)
    keys = make_keys(work / "data", args.tenants)
    print(f"starting twinkled on {device} (log: {work}/twinkled.log) ...", flush=True)
    t0 = time.time()
    daemon, url, log = start_daemon(model_dir, work / "data", work, device,
                                    "--config", str(config))
    try:
        if not healthy(url):
            raise SystemExit(f"twinkled is not ready (exit code {daemon.poll()})")
        print(f"  ready in {time.time() - t0:.0f} s at {url}", flush=True)
        steps: list[list[dict]] = [[] for _ in keys]

        def save() -> None:  # after every step: a run cut short keeps what it measured
            if args.write:
                Path(args.write).write_text(report(args, steps, device, config))

        run_tenants(args, url, keys, model_dir.name, vocab, work, daemon, steps, save)
    except BaseException:
        tail = (work / "twinkled.log").read_text(errors="replace").splitlines()[-40:]
        print("twinkled.log, last lines:\n" + "\n".join(tail), file=sys.stderr)
        raise
    finally:
        daemon.terminate()
        daemon.wait(timeout=120)
        log.close()
    emit(report(args, steps, device, config), args.write)


if __name__ == "__main__":
    main()
