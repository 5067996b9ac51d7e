"""Long rows (issue 38): one tenant's row of S tokens, trained alone and beside a small
tenant, at context parallelism cp (one process per rank, NCCL on GPUs, gloo on a CPU).

Per row length: tok/s of the long tenant's step (forward_backward + optim_step, median of
`--rounds` after a warm-up), each rank's peak memory, and the small tenant's step time
(8 rows of 512 tokens) alone and co-batched with the long row in the same step (its p99
over the rounds: what a small tenant waits next to a 128K one). The model: the shape's
random weights, RoPE scaled by YaRN to `max(--seq)` (its config says 40,960 positions),
one adapter of rank 32 on attention and MLP per tenant, recompute on.

    python bench/bench_long.py --shape qwen3-8b --seq 32768,65536 --cp 1
    python bench/bench_long.py --shape qwen3-8b --seq 65536,131072 --cp 2
    python bench/bench_long.py --shape tiny --device cpu --seq 512 --cp 2   # a smoke run
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from output import emit, section_path  # noqa: E402

RANK = 32
SMALL = (8, 512)  # the small tenant: rows x tokens


def _step(engine, reqs, cp, names) -> float:
    from twinkled.protocol.types import AdamParams

    if engine.model.device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    engine.forward_backward(reqs, checked=True, cp=cp)
    engine.optim_steps([(n, AdamParams(learning_rate=1e-5)) for n in names])
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def _rank(rank: int, args: dict, port: int, queue) -> None:
    from twinkled.engine.context_parallel import ContextParallel
    from twinkled.engine.engine import Engine
    from twinkled.protocol.types import Datum, ForwardBackwardRequest, LoraConfig

    cuda = args["device"] == "cuda"
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    cp = None
    if args["cp"] > 1:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=args["cp"])
        cp = ContextParallel(args["cp"], args["min_tokens"], dist.group.WORLD)
    longest = max(args["seq"])
    engine = Engine(args["model"], dtype=torch.bfloat16 if cuda else torch.float32,
                    device=device, max_rank=RANK, recompute="on", token_budget=longest,
                    dp_group=dist.group.WORLD if cp else None, max_seq_len=longest)
    for name, seed in (("long", 1), ("small", 2)):
        engine.add_adapter(name, LoraConfig(rank=RANK, alpha=RANK, seed=seed,
                                            train_unembed=False))
        a = engine.pool.get(name)
        for key in a.bank.shapes:
            torch.nn.init.normal_(a.bank.B[key][a.slot], std=0.01)
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model.vocab_size

    def datum(n):
        seq = torch.randint(0, vocab, (n + 1,), generator=gen)
        return Datum(seq[:-1], {"target_tokens": seq[1:], "weights": torch.ones(n)})

    # The small tenant's rows, split over the ranks as data parallelism splits them.
    n_small = SMALL[0] // args["cp"]
    small = ForwardBackwardRequest("small", [datum(SMALL[1]) for _ in range(n_small)])
    lines = []
    for S in args["seq"]:
        long = ForwardBackwardRequest("long", [datum(S)])
        cases = (("long", [long], ["long"]), ("small", [small], ["small"]),
                 ("both", [long, small], ["long", "small"]))
        for label, reqs, names in cases:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            _step(engine, reqs, cp, names)  # warm-up
            times = [_step(engine, reqs, cp, names) for _ in range(args["rounds"])]
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
            lines.append((S, label, statistics.median(times),
                          sorted(times)[min(len(times) - 1, int(0.99 * len(times)))], peak))
            # as it comes: a long row that outruns the caller's time limit keeps the rest
            print(f"rank {rank}: {S} {label} median {lines[-1][2]:.3f} s, p99 "
                  f"{lines[-1][3]:.3f} s, peak {peak:.1f} GiB", flush=True)
    queue.put((rank, lines))
    if cp is not None:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seq", default="32768,65536,131072")
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--min-tokens", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="the section's file (default bench/results/)")
    a = p.parse_args()
    from bench_engine import build_model

    seq = [int(s) for s in a.seq.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        build_model(a.shape, model, torch.bfloat16 if a.device == "cuda" else torch.float32,
                    a.device, None)
        args = {"model": str(model), "device": a.device, "cp": a.cp, "seq": seq,
                "min_tokens": min(a.min_tokens, min(seq) - 1), "rounds": a.rounds}
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, args, port, queue)) for r in range(a.cp)]
        for proc in procs:
            proc.start()
        got = dict(queue.get() for _ in procs)
        for proc in procs:
            proc.join()
    head = (f"### Long rows: {a.shape}, cp {a.cp} on {a.device} "
            f"({torch.cuda.get_device_name() if a.device == 'cuda' else os.cpu_count()})\n\n"
            "| tokens | step | median s | p99 s | tok/s | peak GiB per rank |\n"
            "|---|---|---|---|---|---|\n")
    rows = []
    for k, (S, label, med, p99, _) in enumerate(got[0]):
        tokens = {"long": S, "small": SMALL[0] * SMALL[1], "both": S + SMALL[0] * SMALL[1]}[label]
        peaks = "/".join(f"{got[r][k][4]:.1f}" for r in sorted(got))
        rows.append(f"| {S} | {label} | {med:.3f} | {p99:.3f} | {tokens / med:,.0f} | {peaks} |")
    emit(head + "\n".join(rows) + "\n", a.out if a.out is not None else section_path("long"))


if __name__ == "__main__":
    main()
