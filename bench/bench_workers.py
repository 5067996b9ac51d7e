"""Data parallelism across worker ranks: tokens/s with 1 worker against N workers.

The same daemon and the same tinker tenants as bench_multitenant.py, at the same batch per
worker: with 1 worker, `--tenants` tenants each send 1 x S tokens per step; with N workers,
N times as many tenants do, so every rank holds as many rows as the single worker did.
Each configuration gets a fresh daemon, in the same run.

    python bench/bench_workers.py --devices cuda:0,cuda:1 --shape qwen2.5-0.5b   # 2 GPUs
    python bench/bench_workers.py --devices cpu,cpu                              # CPU (gloo)
    python bench/bench_workers.py --devices cuda:0-3 --sizes 1,2,4 --shape qwen2.5-0.5b
    python bench/bench_workers.py --devices cuda:0-3 --sizes 1,2,4 --lanes   # a lane per GPU

With `--lanes`, N workers are N lanes of one worker (`twinkled serve --lanes N`: each
tenant's adapter on one GPU, each GPU stepping on its own) instead of one data-parallel
group of N ranks.

With `--remote`, ranks 1..N-1 of each group are not the head's own: one `twinkled worker
--join` agent on loopback brings them (the head's cost per remote rank: the join, the step
socket and the heartbeats, against the same group run with `--remote` left off):

    python bench/bench_workers.py --devices cpu,cpu --sizes 1,2 --remote
    python bench/bench_workers.py --devices cuda:0-3 --sizes 1,4 --remote --shape qwen2.5-0.5b

With `--remote --lanes`, lanes 1..N-1 are the agent's (`twinkled worker --join --lanes
N-1`): the head's cost per remote lane, against `--lanes` alone (all lanes the head's):

    python bench/bench_workers.py --devices cuda:0-3 --sizes 4 --lanes --remote --shape qwen2.5-0.5b

`--local-too` runs each size twice in the same run, all lanes (or ranks) the head's first,
then with the agent's: the ratio is the remote lanes' cost. Each row also gives the head
process's own CPU time per daemon step (its HTTP, planning and ZeroMQ work, not its
workers'), the cost that grows with remote lanes and does not depend on the card:

    python bench/bench_workers.py --devices cpu,cpu --sizes 2 --lanes --remote --local-too
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_multitenant import make_keys, pct, run_tenants, start_daemon  # noqa: E402
from output import section_path  # noqa: E402


def planner_report(data: Path) -> None:
    """What the daemon's planner made of the run: steps, step-time target, fitted cost."""
    out = subprocess.run([sys.executable, "-m", "twinkled", "ctl", "--data-dir", str(data),
                          "status", "--json"], capture_output=True, text=True)
    try:
        s = json.loads(out.stdout)
    except ValueError:
        print("(no status)", out.stderr[-300:])
        return
    print(f"planner: {s['steps']} steps, target {s.get('step_target_ms')} ms, "
          f"cost {s.get('step_cost')}")


def path_report(url: str) -> None:
    """Where a step's time went, from the daemon's /metrics (since it started): the daemon's
    step time, each rank's busy time inside it, and the wait for clients between steps."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    m: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            m[name] = float(value)
    steps = sum(v for k, v in m.items() if k.startswith("twinkle_step_seconds_count"))
    step_s = sum(v for k, v in m.items() if k.startswith("twinkle_step_seconds_sum"))
    busy = {_label(k, "lane") + "." + _label(k, "rank"): v for k, v in m.items()
            if k.startswith("twinkle_worker_busy_seconds_total")}
    gathers = m.get("twinkle_gather_wait_seconds_count", 0.0)
    gather_s = m.get("twinkle_gather_wait_seconds_sum", 0.0)
    if steps:
        # lane.rank (a lane's steps are its own: with lanes, this is per step of any lane)
        ranks = ", ".join(f"rank {r} {1e3 * b / steps:.1f} ms" for r, b in sorted(busy.items()))
        print(f"path: {steps:.0f} steps, daemon step {1e3 * step_s / steps:.1f} ms "
              f"(ranks busy: {ranks}); gather wait {1e3 * gather_s / max(gathers, 1):.1f} ms "
              f"x {gathers:.0f}")


def head_cpu_s(pid: int) -> float:
    """The process's own CPU seconds (user + system, not its children's: /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def daemon_steps(url: str) -> float:
    """The daemon's steps so far, every lane's (/metrics)."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return sum(float(line.rpartition(" ")[2]) for line in r.read().decode().splitlines()
                   if line.startswith("twinkle_step_seconds_count"))


def _label(sample: str, name: str) -> str:
    """A label's value in a Prometheus sample line's name part ("0" when absent)."""
    part = sample.split(f'{name}="')
    return part[1].split('"')[0] if len(part) > 1 else "0"


def prepare(args: argparse.Namespace, devices: list[str], prefix: str) -> tuple:
    """What a run of daemons on `devices` shares: (gpu?, dtype, S, timed steps, work dir,
    model dir, vocab), the model of `args.shape` written once into the work dir."""
    import torch
    from bench_engine import build_model

    gpu = devices[0].startswith("cuda")
    dtype = torch.bfloat16 if gpu else torch.float32
    seq = args.seq or (512 if gpu else 64)
    steps = args.steps or (20 if gpu else 6)
    work = Path(tempfile.mkdtemp(prefix=prefix))
    vocab = build_model(args.shape, work / "model", dtype, devices[0] if gpu else "cpu")
    if gpu:
        torch.cuda.empty_cache()
    return gpu, dtype, seq, steps, work, work / "model", vocab


def join_remote(work: Path, devices: list[str], model_dir: Path, lanes: bool = False
                ) -> tuple[tuple, subprocess.Popen]:
    """The head's config for `devices` as remote ranks (or lanes, one a device), and the
    agent that brings them (started first: it retries until the head listens; the head
    waits for its ranks; its lanes: `wait_lanes`)."""
    import socket

    from twinkled.workers.join import ensure_token

    work.mkdir(parents=True)
    token = work / "join.key"
    ensure_token(token)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = work / "join.toml"
    cfg.write_text(f'join_listen = "tcp://127.0.0.1:{port}"\njoin_token_file = "{token}"\n'
                   + ("" if lanes else f"remote_ranks = {len(devices)}\n")
                   + "join_timeout_s = 300\n")
    agent = subprocess.Popen(
        [sys.executable, "-m", "twinkled", "worker", "--join", f"tcp://127.0.0.1:{port}",
         "--devices", ",".join(devices), "--token-file", str(token), "--model", str(model_dir),
         "--lanes", str(len(devices) if lanes else 0)],
        stdout=open(work / "agent.log", "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115
    return ("--config", str(cfg)), agent


def wait_lanes(data: Path, n: int, timeout: float = 900) -> None:
    """Until the daemon in `data` has `n` lanes up (the agent's have loaded the model)."""
    import time

    from twinkled.server.ctl import Target

    deadline = time.time() + timeout
    while time.time() < deadline:
        lanes = Target(data, None, None).call("status").get("lanes") or []
        if len(lanes) == n and not any(lane["down"] for lane in lanes):
            return
        time.sleep(1)
    raise SystemExit(f"{n} lanes did not come up; see the agent's log")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", required=True, help="the N-worker group, e.g. cuda:0,cuda:1")
    ap.add_argument("--sizes", default=None,
                    help="worker counts to run, one after another (default: 1 and all); "
                         "a count may repeat, and the 1-worker runs' mean is the baseline")
    ap.add_argument("--shape", default="tiny", choices=("tiny", "qwen2.5-0.5b", "qwen3-8b"))
    ap.add_argument("--tenants", type=int, default=8, help="tenants per worker")
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--config", default=None, help="a twinkled TOML config for the daemons")
    ap.add_argument("--lanes", action="store_true",
                    help="one lane per worker (twinkled serve --lanes N), not one group")
    ap.add_argument("--remote", action="store_true",
                    help="ranks past the first join from a `twinkled worker --join` agent "
                         "on loopback (the head's cost per remote rank)")
    ap.add_argument("--local-too", action="store_true",
                    help="with --remote: each size also runs with every rank the head's "
                         "first, in the same run")
    ap.add_argument("--trace", action="store_true",
                    help="trace each daemon's steps (TWINKLED_TRACE) and print trace_report")
    ap.add_argument("--write", default=section_path("workers"))
    args = ap.parse_args()

    from bench_engine import header

    from twinkled.server.layout import expand_devices

    devices = expand_devices(args.devices)
    sizes = [int(n) for n in args.sizes.split(",")] if args.sizes else [1, len(devices)]
    gpu, dtype, seq, steps, work, model_dir, vocab = prepare(args, devices, "bench_workers_")

    runs = [(n, remote) for n in sizes
            for remote in ((False, True) if args.local_too and n > 1 else (args.remote,))]
    rows = []
    for i, (group, remote) in enumerate((devices[:n], remote) for n, remote in runs):
        data = work / f"data{i}-{len(group)}"  # a repeated size starts from an empty store
        n = args.tenants * len(group)
        keys = make_keys(data, n)
        extra = (("--config", args.config) if args.config else ()) + \
            (("--lanes", str(len(group))) if args.lanes else ())
        traced = work / f"trace{i}-{len(group)}.jsonl"
        if args.trace:
            os.environ["TWINKLED_TRACE"] = str(traced)
        agent, lanes = None, len(group)
        if remote and len(group) > 1:
            if args.config:
                raise SystemExit("--remote takes no --config")
            extra, agent = join_remote(work / f"join{i}", group[1:], model_dir, args.lanes)
            group = group[:1]
        daemon, url, log = start_daemon(model_dir, data, work, group[0], "--devices",
                                        ",".join(group), *extra)
        try:
            if agent is not None and args.lanes:
                wait_lanes(data, lanes)
            cpu0, steps0 = head_cpu_s(daemon.pid), daemon_steps(url)
            res = run_tenants(url, keys, model_dir.name, vocab, seq, steps, [1] * n)
            head_ms = 1e3 * (head_cpu_s(daemon.pid) - cpu0) / max(daemon_steps(url) - steps0, 1)
            planner_report(data)
            path_report(url)
            if args.trace:  # the timed window: about 2 steps per tenant round
                subprocess.run([sys.executable, str(HERE / "trace_report.py"), str(traced),
                                "--last", str(2 * steps)], check=False)
        finally:
            daemon.terminate()
            daemon.wait(timeout=120)
            log.close()
            if agent is not None:
                agent.terminate()
                agent.wait(timeout=60)
        late = max(r.get("late", 0.0) for r in res)
        if late > 0.5:  # a tenant that started late stretches the window: say so
            print(f"WARNING: a tenant began its timed steps {late:.1f} s after the others")
        wall = max(r["t1"] for r in res) - min(r["t0"] for r in res)
        lat = [x for r in res for x in r["lat"]]
        rows.append((n // args.tenants, n, sum(r["tokens"] for r in res) / wall, pct(lat, 0.5),
                     pct(lat, 0.99), head_ms, "remote" if remote and n > args.tenants
                     else "head"))

    # the 1-worker figure moves between runs on one machine (19k-25k tok/s on the 0.5B):
    # repeat it (--sizes 1,2,4,1) and compare with the mean
    ones = [r[2] for r in rows if r[0] == 1] or [rows[0][2]]
    base = sum(ones) / len(ones)
    title = "Worker lanes (one per GPU)" if args.lanes else "Worker ranks (data parallel)"
    if args.remote:
        title += ", ranks past the first joined from another host on loopback"
    text = header("cuda" if gpu else "cpu").replace("Engine vs peft", title)
    text += (f"\n### {args.shape} ({','.join(devices)}, {str(dtype).split('.')[-1]}, LoRA r=32, "
             f"S={seq}, {args.tenants} tenants per worker at 1 x S each, {steps} timed steps)\n\n"
             "| workers | past the first | tenants | tokens/s | vs 1 worker | step p50 (s) "
             "| step p99 (s) | head CPU ms/step |\n|---:|---|---:|---:|---:|---:|---:|---:|\n")
    for w, n, tps, p50, p99, head_ms, where in rows:
        text += (f"| {w} | {where} | {n} | {tps:,.0f} | {tps / base:.2f}x | {p50:.3f} "
                 f"| {p99:.3f} | {head_ms:.1f} |\n")
    print(text)
    if args.write:
        with Path(args.write).open("a") as f:
            f.write("\n" + text)
        print(f"appended to {args.write}")


if __name__ == "__main__":
    main()
