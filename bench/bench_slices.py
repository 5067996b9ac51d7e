"""A long generation next to short samples and training, through the daemon: what sliced
sampling (`sample_slice_ms`) buys the other tenants.

A real `twinkled serve` on a model of the chosen shape, three tenants with unmodified
tinker clients (one thread each): A asks for one long sample (`--long` tokens, no stop),
B then sends short samples (16 tokens) one after another, C trains (forward_backward +
optim_step on 1 x S tokens) meanwhile. Run once with the given `sample_slice_ms` and once
with 0 (each sampling step to the end, the behaviour before slices). Reported per run: A's
time, B's and C's latencies (p50, p99, max) while A runs; and what slicing costs a
rollout alone: `--rollout` samples of lengths spread from long/8 to long/2 sent at once by
one tenant, their tokens/s (each finished sample ends its slice, one more round trip).

    python bench/bench_slices.py --shape tiny                  # CPU
    python bench/bench_slices.py --shape qwen2.5-0.5b          # GPU
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

from output import emit, section_path  # bench/ is the script's directory

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _tenants(url: str, keys: list[str], model: str, vocab: int, long: int, seq: int,
             n_rollout: int) -> dict:
    import random

    import tinker

    clients = [tinker.ServiceClient(base_url=url, api_key=k) for k in keys]
    a = clients[0].create_sampling_client(base_model=model).result(timeout=600)
    b = clients[1].create_sampling_client(base_model=model).result(timeout=600)
    tc = clients[2].create_lora_training_client(base_model=model, rank=32,
                                                train_unembed=False).result(timeout=600)
    rng = random.Random(0)
    ids = [rng.randrange(vocab) for _ in range(seq + 1)]
    datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": ids[1:]})
    adam = tinker.types.AdamParams(learning_rate=1e-4)
    prompt = tinker.types.ModelInput.from_ints([rng.randrange(vocab) for _ in range(32)])
    short = tinker.types.SamplingParams(max_tokens=16, temperature=1.0, stop=[])
    for _ in range(2):  # warm up every path (the first sample makes the KV pool)
        b.sample(prompt, 1, short).result(timeout=600)
        tc.forward_backward([datum], "cross_entropy").result(timeout=600)
        tc.optim_step(adam).result(timeout=600)
    running = threading.Event()
    out: dict = {"short": [], "train": []}

    def shorts() -> None:
        while running.is_set():
            s = time.perf_counter()
            b.sample(prompt, 1, short).result(timeout=3600)
            out["short"].append(time.perf_counter() - s)

    def training() -> None:
        while running.is_set():
            s = time.perf_counter()
            fb = tc.forward_backward([datum], "cross_entropy")
            opt = tc.optim_step(adam)
            fb.result(timeout=3600)
            opt.result(timeout=3600)
            out["train"].append(time.perf_counter() - s)

    rollout = []  # (max_tokens) of the rollout's samples, spread out
    for i in range(n_rollout):
        rollout.append(long // 8 + (long // 2 - long // 8) * i // max(1, n_rollout - 1))
    s = time.perf_counter()
    futs = [a.sample(prompt, 1, tinker.types.SamplingParams(max_tokens=n, temperature=1.0,
                                                             stop=[])) for n in rollout]
    made = sum(len(f.result(timeout=3600).sequences[0].tokens) for f in futs)
    out["rollout"] = made / (time.perf_counter() - s)

    running.set()
    s = time.perf_counter()
    fut = a.sample(prompt, 1, tinker.types.SamplingParams(max_tokens=long, temperature=1.0,
                                                           stop=[]))
    time.sleep(0.2)  # A's sample runs first
    threads = [threading.Thread(target=f) for f in (shorts, training)]
    for t in threads:
        t.start()
    made = len(fut.result(timeout=3600).sequences[0].tokens)
    out["long"] = time.perf_counter() - s
    running.clear()
    for t in threads:
        t.join()
    out["made"] = made
    for c in clients:
        c.close("success")
    return out


def _stats(xs: list[float]) -> str:
    from bench_multitenant import pct

    if not xs:
        return "none finished | | "
    return f"{len(xs)} | {pct(xs, 0.5):.3f} / {pct(xs, 0.99):.3f} | {max(xs):.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="tiny", choices=("tiny", "qwen2.5-0.5b", "qwen3-8b"))
    ap.add_argument("--long", type=int, default=None, help="tokens of A's sample")
    ap.add_argument("--seq", type=int, default=None, help="tokens of C's datum")
    ap.add_argument("--slice-ms", type=float, default=250.0)
    ap.add_argument("--rollout", type=int, default=64, help="samples of the rollout")
    ap.add_argument("--write", default=section_path("slices"))
    args = ap.parse_args()

    import torch
    from bench_engine import build_model, header
    from bench_multitenant import make_keys, start_daemon

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    long = args.long or (4096 if device == "cuda" else 1000)
    seq = args.seq or (512 if device == "cuda" else 64)
    work = Path(tempfile.mkdtemp(prefix="bench_slices_"))
    model_dir = work / "model"
    vocab = build_model(args.shape, model_dir, dtype, device)
    rows = []
    for slice_ms in (args.slice_ms, 0.0):
        data = work / f"data{slice_ms:g}"
        keys = make_keys(data, 3)
        cfg = work / f"slices{slice_ms:g}.toml"
        cfg.write_text(f"sample_slice_ms = {slice_ms}\n")
        daemon, url, log = start_daemon(model_dir, data, work, device, "--config", str(cfg))
        try:
            res = _tenants(url, keys, model_dir.name, vocab, long, seq, args.rollout)
        finally:
            daemon.terminate()
            daemon.wait(timeout=120)
            log.close()
        rows.append((slice_ms, res))

    text = header(device).replace("Engine vs peft", "Sliced sampling through the daemon")
    text += (f"\n### {args.shape} ({device}, {str(dtype).split('.')[-1]}): tenant A samples "
             f"{long} tokens; meanwhile B sends 16-token samples one after another and C "
             f"trains (LoRA r=32, 1 x {seq} tokens + optim_step per step); unmodified tinker "
             "0.38 clients\n\n"
             "| sample_slice_ms | A's sample (s) | B samples | B p50 / p99 (s) | B max (s) "
             f"| C steps | C p50 / p99 (s) | C max (s) | rollout of {args.rollout} alone "
             "(tok/s) |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    for slice_ms, r in rows:
        text += (f"| {slice_ms:g} | {r['long']:.2f} ({r['made']} tokens) | "
                 f"{_stats(r['short'])} | {_stats(r['train'])} | {r['rollout']:,.0f} |\n")
    emit(text, args.write)


if __name__ == "__main__":
    main()
