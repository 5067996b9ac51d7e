"""A small tenant next to a long-context one, through a real `twinkled serve` (issue 38).

bench_long.py measures the engine: a small tenant co-batched with a 131,072-token row waits
that row's whole step. What a user feels is the daemon's answer: its planner sees the long
row's cost, and the small tenant's steps run in the steps around it (or, with preemptible
steps, between its micro-batches). This runs one daemon on `--ranks` GPUs with `--cp`, and
the unmodified tinker client:

- alone: the small tenant (`--small-rows` x 512 tokens a step) for `--small-steps` steps;
- beside: the same, while another tenant (a process of its own) trains one row of S tokens
  a step, for each S of `--seq`; the small tenant's p50/p99 and the long tenant's tok/s.

With `--lanes N` the daemon splits the ranks into N lanes (`twinkled serve --lanes N`): the
long run's first row over `long_row_tokens` makes it long-context, and the small tenant's run
goes to a lane without it (core/long_rows.py); the table says where it went. Each phase's
runs end with their session (the client's close), so the next phase places its own afresh.

    python bench/long_daemon.py --shape qwen3-8b --seq 65536,131072 --ranks 2 --cp 2
    python bench/long_daemon.py --shape qwen3-8b --seq 65536 --ranks 2 --cp 1 --lanes 2
    python bench/long_daemon.py --shape tiny --device cpu --seq 512 --ranks 2 --cp 2  # a smoke run
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

from bench_multitenant import make_keys, pct, start_daemon  # noqa: E402
from output import emit, section_path  # noqa: E402

T = 900  # one step's result, at most (a 131,072-token row takes ~40 s on 2 H200s)
SMALL_SEQ = 512  # the small tenant's rows (at most half the shortest --seq: a smoke run's)
SMALL_WARMUP = 2  # the small tenant's first steps, not counted (compiles, graph captures)


def _datum(rng: random.Random, vocab: int, n: int):
    import tinker

    ids = [rng.randrange(vocab) for _ in range(n + 1)]
    return tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
                              loss_fn_inputs={"target_tokens": ids[1:]})


def _progress(until: Path) -> Path:
    """Where the long tenant writes how many steps it has finished (`_steps`' progress)."""
    return until.with_name(until.name + ".n")


def _steps(url: str, key: str, model: str, vocab: int, rows: int, seq: int, steps: int,
           until: Path | None = None, before_close=None, warmup: int = 0,
           progress: Path | None = None, more=None) -> list[tuple[float, float]]:
    """(start, seconds) of each forward_backward + optim_step; with `until`, steps go on
    until that file exists (the small tenant's run beside this one is over), and while
    `more()` says so. The first `warmup` steps are not counted (compiles, captures). With
    `progress`, the count of finished steps is written there after each step, and
    `progress`.sent once the first forward_backward is submitted. The session
    ends after (its run leaves the daemon), `before_close()` called just before."""
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker

    rng = random.Random(seq)
    data = [_datum(rng, vocab, seq) for _ in range(rows)]
    adam = tinker.types.AdamParams(learning_rate=1e-5)
    sc = tinker.ServiceClient(base_url=url, api_key=key)
    tc = sc.create_lora_training_client(base_model=model, rank=32).result(timeout=T)
    out = []
    while (len(out) < steps + warmup or (until is not None and not until.exists())
           or (more is not None and more())):
        t0 = time.perf_counter()
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(adam)
        if progress is not None and not out:
            progress.with_suffix(".sent").touch()
        fb.result(timeout=T)
        opt.result(timeout=T)
        out.append((t0, time.perf_counter() - t0))
        if progress is not None:
            progress.write_text(str(len(out)))
    out = out[warmup:]
    if before_close is not None:
        before_close()
    sc.close("success").result(timeout=T)
    return out


def _placement(data: Path) -> str:
    """Where the daemon's runs are now (`ctl status`): each lane's adapters, the long
    lanes marked, and whether a short run shares a long run's lane."""
    from twinkled.server.ctl import Target

    s = Target(data, None, None).call("status")
    if "lanes" not in s:
        return "one lane"
    longs = {r["lane"] for r in s.get("long_runs", [])}
    shared = sum(lane["adapters"] - sum(r["lane"] == lane["lane"] for r in s["long_runs"])
                 for lane in s["lanes"] if lane["lane"] in longs)
    lanes = ", ".join(f"lane {lane['lane']}: {lane['adapters']}{' (long)' * lane['long']}"
                      for lane in s["lanes"])
    return f"{lanes}; {'SHARED' if shared else 'apart'}"


def _wait_long(data: Path, timeout: float = 300) -> None:
    """Until the daemon counts a run as long-context (its first long row submitted)."""
    from twinkled.server.ctl import Target

    deadline = time.monotonic() + timeout
    while not Target(data, None, None).call("status").get("long_runs") \
            and time.monotonic() < deadline:
        time.sleep(0.2)


def client(args: argparse.Namespace) -> None:
    """The long tenant's process: steps until `--until` exists; prints its steps as JSON."""
    got = _steps(args.url, args.key, args.model, args.vocab, 1, args.long, 1, Path(args.until),
                 progress=_progress(Path(args.until)))
    print(json.dumps(got), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seq", default="65536,131072", help="the long tenant's row lengths")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--lanes", type=int, default=1, help="twinkled serve --lanes N")
    ap.add_argument("--long-row-tokens", type=int, default=None,
                    help="the daemon's long_row_tokens (default: its own, unless the shortest "
                    "--seq is not over it: then the small rows' length)")
    ap.add_argument("--small-seq", type=int, default=None,
                    help=f"the small tenant's rows (default {SMALL_SEQ}, at most half the "
                    "shortest --seq)")
    ap.add_argument("--small-rows", type=int, default=8)
    ap.add_argument("--small-steps", type=int, default=10)
    ap.add_argument("--out", default=None, help="the section's file (default bench/results/)")
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    for name in ("url", "key", "model", "until"):
        ap.add_argument(f"--{name}", help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--long", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        return client(args)
    import torch
    from bench_engine import build_model

    from twinkled.protocol.config import Config

    seqs = [int(s) for s in args.seq.split(",")]
    small_seq = args.small_seq or min(SMALL_SEQ, min(seqs) // 2)
    long_rows = args.long_row_tokens
    if long_rows is None:  # a smoke run's short rows must still count as long
        long_rows = Config.long_row_tokens if min(seqs) > Config.long_row_tokens else small_seq
    cuda = args.device.startswith("cuda")
    work = Path(tempfile.mkdtemp(prefix="bench_long_daemon_"))
    config = work / "twinkled.toml"
    config.write_text(f"long_row_tokens = {long_rows}\n")
    model = work / "model"
    vocab = build_model(args.shape, model, torch.bfloat16 if cuda else torch.float32,
                        args.device, None)
    data = work / "data"
    small_key, long_key = make_keys(data, 2)
    daemon, url, log = start_daemon(model, data, work, "cuda" if cuda else "cpu",
                                    "--workers", str(args.ranks),
                                    "--cp", str(args.cp), "--max-seq-len", str(max(seqs)),
                                    "--lanes", str(args.lanes), "--config", str(config))
    lines = []
    try:
        where = []

        def small(until_file: Path | None = None) -> list[float]:
            # beside a long tenant: its steps go on until the long tenant has finished two
            # steps, so that some of them arrive while a long step is in flight (a 131,072-token
            # row is ~40 s; the small tenant's steps alone ~0.3 s)
            count = None if until_file is None else _progress(until_file)
            more = None if count is None else (
                lambda: int((count.read_text() or "0") if count.exists() else 0) < 2)
            steps = _steps(url, small_key, model.name, vocab, args.small_rows, small_seq,
                           args.small_steps, before_close=lambda: where.append(_placement(data)),
                           warmup=SMALL_WARMUP, more=more)
            if until_file is not None:
                until_file.touch()
            return [s for _, s in steps]

        alone = small()
        lines.append(("alone", alone, None, where[-1]))
        print(f"-- small tenant alone: p50 {pct(alone, .5):.3f} s, p99 {pct(alone, .99):.3f} s",
              flush=True)
        for S in seqs:
            until = work / f"done-{S}"
            long = subprocess.Popen(
                [sys.executable, __file__, "--client", "--url", url, "--key", long_key,
                 "--model", model.name, "--vocab", str(vocab), "--long", str(S),
                 "--until", str(until)], stdout=subprocess.PIPE, text=True)
            sent = _progress(until).with_suffix(".sent")
            while not sent.exists() and long.poll() is None:  # its first step submitted first
                time.sleep(0.1)
            if args.lanes > 1 and S > long_rows:  # ... and counted as long
                _wait_long(data)
            beside = small(until)
            out, _ = long.communicate(timeout=3 * T)
            long_steps = json.loads(out.strip().splitlines()[-1])
            lines.append((f"beside one row of {S:,} tokens", beside, long_steps, where[-1]))
            print(f"-- beside {S}: small p50 {pct(beside, .5):.3f} s, p99 "
                  f"{pct(beside, .99):.3f} s; the long tenant's steps: "
                  f"{[round(s, 2) for _, s in long_steps]}; runs: {where[-1]}", flush=True)
    finally:
        daemon.terminate()
        daemon.wait(timeout=120)
        log.close()
        if args.out:  # the daemon's log beside the section (a device run returns only $OUT)
            shutil.copy(work / "twinkled.log",
                        Path(args.out).with_name(f"twinkled-lanes{args.lanes}-cp{args.cp}.log"))
    card = torch.cuda.get_device_name() if cuda else f"CPU ranks ({os.cpu_count()} cores)"
    text = (f"### A small tenant beside a long-context one, through the daemon: {args.shape}, "
            f"{args.ranks} x {card}, --cp {args.cp}, --lanes {args.lanes}\n\n"
            f"`{' '.join([Path(sys.argv[0]).name, *sys.argv[1:]])}`: the small tenant "
            f"{args.small_rows} x {small_seq} tokens a step, {args.small_steps} timed steps after {SMALL_WARMUP} warm-up ones (beside a long tenant, until it has finished two steps); the "
            f"long tenant one row a step (long_row_tokens {long_rows}); LoRA r=32, the "
            "unmodified tinker client; runs: adapters per lane at the small tenant's last "
            "step, and whether it shared the long run's lane\n\n"
            "| the small tenant | step p50 (s) | step p99 (s) | the long tenant's tok/s "
            "| runs |\n|---|---:|---:|---:|---|\n")
    for label, small_s, long_steps, placed in lines:
        tps = "-"
        if long_steps:
            S = int(label.split("of ")[1].split(" ")[0].replace(",", ""))
            tps = f"{S / sorted(s for _, s in long_steps)[len(long_steps) // 2]:,.0f}"
        text += (f"| {label} | {pct(small_s, .5):.3f} | {pct(small_s, .99):.3f} | {tps} "
                 f"| {placed} |\n")
    emit(text, args.out if args.out is not None else section_path("long_daemon"))


if __name__ == "__main__":
    main()
