"""A small tenant next to a flooder, through a real daemon: step latency and throughput under
the token-only planner (`target_step_ms = 0`) and the time-bounded one (`"auto"`), one run.

For each policy a fresh `twinkled serve` runs the model; tenants are separate processes
running the unmodified tinker 0.38 client:

- the small tenant: per step, forward_backward of 1 x S tokens then optim_step, waiting for
  both (its step latency, as the client sees it);
- the flooder: several training clients (threads of one process), each keeping several
  forward_backward requests of R x S tokens in flight, an optim_step after every few.

Measured in order: the small tenant alone; the flooder alone (tokens/s of forward_backward
completed); then both: the small tenant's latency, and the flooder's tokens/s while the small
tenant runs. Reported: small p50/p90/p99 alone and together, the ratios, flooder together /
alone, and (new policy) flooder alone against the old policy's flooder alone.

    python bench/bench_flood.py                                   # CPU, tiny model
    python bench/bench_flood.py --policies auto --flood-rows 48 --small-steps 120 \
        --flood-seconds 10 --rounds 3 --trees /tmp/old    # issue 32's CPU shape: 3 clients
        # x 4 requests of 48 x 64 in flight; /tmp/old: an older commit (`git archive`),
        # whose daemon runs interleaved with this checkout's, for a before/after in one run
    python bench/bench_flood.py --shape qwen3-8b --seq 512 --flood-clients 1 \\
        --flood-rows 10 --flood-inflight 1 --flood-optim-every 1    # GPU: the 10x flooder
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from datetime import UTC, datetime
from pathlib import Path

from output import section_path  # bench/ is the script's directory

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def data_for(tinker, rng, vocab: int, rows: int, seq: int) -> list:
    out = []
    for _ in range(rows):
        ids = [rng.randrange(vocab) for _ in range(seq + 1)]
        out.append(tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
                                      loss_fn_inputs={"target_tokens": ids[1:]}))
    return out


def small(args: argparse.Namespace) -> None:
    """The small tenant: `--steps` timed steps; prints [(start, latency)] as JSON."""
    import random

    import tinker

    sc = tinker.ServiceClient(base_url=args.url, api_key=args.key)
    tc = sc.create_lora_training_client(base_model=args.base_model, rank=8,
                                        train_unembed=False).result(timeout=600)
    data = data_for(tinker, random.Random(1), args.vocab, 1, args.seq)
    adam = tinker.types.AdamParams(learning_rate=1e-4)
    out = []
    for i in range(args.steps + 2):  # two warm-up steps
        s = time.time()
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(adam)
        fb.result(timeout=600)
        opt.result(timeout=600)
        if i >= 2:
            out.append((s, time.time() - s))
    print(json.dumps(out))
    sc.close("success")


def flood(args: argparse.Namespace) -> None:
    """The flooder: runs until `--stop` exists; prints [(done_at, tokens)] as JSON. Writes
    `--ready` once every client has its adapter and has finished one request."""
    import random

    import tinker

    sc = tinker.ServiceClient(base_url=args.url, api_key=args.key)
    tcs = [sc.create_lora_training_client(base_model=args.base_model, rank=8,
                                          train_unembed=False).result(timeout=600)
           for _ in range(args.clients)]
    adam = tinker.types.AdamParams(learning_rate=1e-4)
    done: list[tuple[float, int]] = []
    warm = threading.Barrier(args.clients + 1)
    tokens = args.rows * args.seq

    def client(i: int, tc) -> None:
        data = data_for(tinker, random.Random(10 + i), args.vocab, args.rows, args.seq)
        tc.forward_backward(data, "cross_entropy").result(timeout=600)
        tc.optim_step(adam).result(timeout=600)
        warm.wait()
        inflight: deque = deque()
        sent = 0
        while not os.path.exists(args.stop):
            while len(inflight) < args.inflight:
                inflight.append(tc.forward_backward(data, "cross_entropy"))
                sent += 1
                if sent % args.optim_every == 0:
                    tc.optim_step(adam)  # its result is not waited for: the next fb follows it
            inflight.popleft().result(timeout=600)
            done.append((time.time(), tokens))
        for f in inflight:
            f.result(timeout=600)

    threads = [threading.Thread(target=client, args=(i, tc)) for i, tc in enumerate(tcs)]
    for t in threads:
        t.start()
    warm.wait()
    Path(args.ready).write_text(str(time.time()))
    for t in threads:
        t.join()
    print(json.dumps(done))
    sc.close("success")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_daemon(model_dir: Path, work: Path, device: str, config: str, tree: str = ""):
    """`tree`: the checkout whose twinkled serves (its root goes first on PYTHONPATH; ''
    the one on the path already)."""
    import urllib.request

    data = work / "data"
    data.mkdir(parents=True)
    cfg = work / "twinkled.toml"
    cfg.write_text(config)
    keys = {}
    for tenant in ("small", "flood"):
        out = subprocess.run([sys.executable, "-m", "twinkled", "ctl", "--data-dir", str(data),
                              "--create", "keys", "create", "--tenant", tenant],
                             check=True, capture_output=True, text=True).stdout
        keys[tenant] = out.strip().splitlines()[-1]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(work / "twinkled.log", "ab")  # noqa: SIM115 - closed by the caller
    daemon = subprocess.Popen(
        [sys.executable, "-m", "twinkled", "serve", "--model", str(model_dir), "--data-dir",
         str(data), "--port", str(port), "--device", device, "--config", str(cfg),
         "--dtype", "bfloat16" if device.startswith("cuda") else "float32"],
        stdout=log, stderr=subprocess.STDOUT, env=daemon_env(tree),
        cwd=Path(tree).resolve() if tree else None)  # `-m` imports from the cwd first
    for _ in range(1200):
        try:
            with urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=2) as r:
                if json.loads(r.read())["status"] == "ok":
                    return daemon, url, log, keys, data
        except OSError:
            pass
        if daemon.poll() is not None:
            raise SystemExit(f"twinkled exited ({daemon.returncode}); see {work}/twinkled.log")
        time.sleep(0.5)
    raise SystemExit("twinkled did not become ready")


def daemon_env(tree: str) -> dict:
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(Path(tree).resolve()), *filter(None, [env.get("PYTHONPATH")])])
    return env


def daemon_status(data: Path) -> dict:
    return json.loads(subprocess.run(
        [sys.executable, "-m", "twinkled", "ctl", "--data-dir", str(data), "status", "--json"],
        capture_output=True, text=True, check=True).stdout)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def tenant_cmd(mode: str, url: str, key: str, model: str, vocab: int, args) -> list[str]:
    return [sys.executable, __file__, f"--{mode}", "--url", url, "--key", key,
            "--base-model", model, "--vocab", str(vocab), "--seq", str(args.seq)]


def run_small(url, key, model, vocab, args) -> list[tuple[float, float]]:
    out = subprocess.run(tenant_cmd("small", url, key, model, vocab, args)
                         + ["--steps", str(args.small_steps)],
                         check=True, capture_output=True, text=True, timeout=3600).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_policy(model_dir: Path, vocab: int, device: str, target: str, args, work: Path,
               tree: str = "") -> dict:
    """One daemon: small alone, flooder alone, both. Returns the measurements."""
    config = f"target_step_ms = {target}\n" + (
        f"worker_threads = {args.worker_threads}\n" if device == "cpu" else "") + (
        f"token_budget = {args.token_budget}\n" if args.token_budget else "")
    daemon, url, log, keys, data = start_daemon(model_dir, work, device, config, tree)
    name = model_dir.name
    try:
        alone = [lat for _, lat in run_small(url, keys["small"], name, vocab, args)]
        ready, stop = work / "flood.ready", work / "flood.stop"
        fl = subprocess.Popen(tenant_cmd("flood", url, keys["flood"], name, vocab, args)
                              + ["--clients", str(args.flood_clients), "--rows",
                                 str(args.flood_rows), "--inflight", str(args.flood_inflight),
                                 "--optim-every", str(args.flood_optim_every),
                                 "--ready", str(ready), "--stop", str(stop)],
                              stdout=subprocess.PIPE, text=True)
        while not (ready.exists() and ready.read_text()):  # (written, not just made)
            if fl.poll() is not None:
                raise SystemExit("the flooder failed")
            time.sleep(0.2)
        t_alone = float(ready.read_text()) + 2  # the planner's model settles meanwhile
        time.sleep(2 + args.flood_seconds)
        before = daemon_status(data)
        together = run_small(url, keys["small"], name, vocab, args)
        status = daemon_status(data)
        stop.write_text("")
        done = json.loads(fl.communicate(timeout=600)[0].strip().splitlines()[-1])
    finally:
        daemon.terminate()
        daemon.wait(timeout=120)
        log.close()

    def rate(t0: float, t1: float) -> float:
        return sum(n for t, n in done if t0 <= t < t1) / (t1 - t0)

    t0, t1 = together[0][0], together[-1][0] + together[-1][1]
    served = {t: status["tenants"][t]["served_s"] - before["tenants"].get(t, {}).get("served_s", 0)
              for t in ("small", "flood")}
    return {"small_share": served["small"] / (sum(served.values()) or 1), "target": target,
            "alone": alone, "together": [lat for _, lat in together],
            "flood_alone": rate(t_alone, t_alone + args.flood_seconds),
            "flood_together": rate(t0, t1),
            "step_target_ms": status.get("step_target_ms"), "cost": status.get("step_cost")}


def report(results: list[dict], args, device: str) -> str:
    import torch

    card = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    lines = [f"## Small tenant next to a flooder, token-only vs time-bounded steps, "
             f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC\n",
             f"- machine: {os.uname().nodename} ({os.cpu_count()} CPUs, load average "
             f"{os.getloadavg()[0]:.1f} at the end); card: {card}; torch {torch.__version__}",
             f"- command: `python {' '.join(sys.argv)}`",
             f"- model {args.shape}; small tenant: 1 x {args.seq} + optim_step per step, "
             f"{args.small_steps} timed steps; flooder: {args.flood_clients} training clients x "
             f"{args.flood_inflight} forward_backward of {args.flood_rows} x {args.seq} in "
             f"flight, optim_step every {args.flood_optim_every}; flooder alone over "
             f"{args.flood_seconds} s" + (f"; CPU worker with {args.worker_threads} torch "
                                           "thread(s)" if device == "cpu" else "") + "\n",
             "| run | daemon | policy | step target | small alone p50 / p90 / p99 (s) | next to the flooder "
             "p50 / p90 / p99 (s) | ratio p50 / p90 / p99 | flooder alone (tok/s) | "
             "flooder together (tok/s) | together / alone | small's share of step time "
             "together |",
             "|---:|---|---|---:|---|---|---|---:|---:|---:|"]
    for i, r in enumerate(results):
        a = [pct(r["alone"], q) for q in (0.5, 0.9, 0.99)]
        t = [pct(r["together"], q) for q in (0.5, 0.9, 0.99)]
        label = "token-only (`target_step_ms = 0`)" if r["target"] == "0" else \
            f"time-bounded (`target_step_ms = {r['target']}`)"
        tgt = "–" if r["target"] == "0" else f"{r['step_target_ms']} ms"
        lines.append(f"| {i + 1} | {r['tree'] or 'this checkout'} | {label} | {tgt} | {' / '.join(f'{x:.3f}' for x in a)} | "
                     f"{' / '.join(f'{x:.3f}' for x in t)} | "
                     f"{' / '.join(f'{y / x:.2f}' for x, y in zip(a, t, strict=True))} | "
                     f"{r['flood_alone']:,.0f} | {r['flood_together']:,.0f} | "
                     f"{r['flood_together'] / r['flood_alone']:.2f} | "
                     f"{r['small_share']:.0%} |")
    old = [r for r in results if r["target"] == "0" and not r["tree"]]
    for i, r in enumerate(results):
        if r["target"] != "0" and old and not r["tree"]:
            base = max((o for o in old if results.index(o) < i), default=old[0],
                       key=results.index)  # the token-only run just before
            lines.append(f"\nRun {i + 1}: flooder alone, {r['target']} / token-only (run "
                         f"{results.index(base) + 1}): **{r['flood_alone'] / base['flood_alone']:.2f}**"
                         f" (target >= 0.80). Fitted step cost: `{json.dumps(r['cost'])}`")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for mode in ("small", "flood"):
        ap.add_argument(f"--{mode}", action="store_true", help=argparse.SUPPRESS)
    for opt in ("--url", "--key", "--base-model", "--ready", "--stop"):
        ap.add_argument(opt, help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--clients", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--inflight", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--optim-every", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--shape", default="tiny", choices=("tiny", "qwen2.5-0.5b", "qwen3-8b"))
    ap.add_argument("--seq", type=int, default=None, help="tokens per datum (S)")
    ap.add_argument("--small-steps", type=int, default=30)
    ap.add_argument("--token-budget", type=int, default=None,
                    help="the daemon's token_budget (4096 fits the 8B shape on an 80 GB card)")
    ap.add_argument("--flood-clients", type=int, default=3)
    ap.add_argument("--flood-rows", type=int, default=8, help="datums per request (R)")
    ap.add_argument("--flood-inflight", type=int, default=4)
    ap.add_argument("--flood-optim-every", type=int, default=4)
    ap.add_argument("--flood-seconds", type=float, default=20.0)
    ap.add_argument("--policies", default="0,auto",
                    help="target_step_ms values, in order (0: token-only; auto; a number)")
    ap.add_argument("--trees", default="",
                    help="checkouts whose daemon to run too, comma-separated (e.g. an older "
                    "commit, exported): each policy runs on this checkout and on each of "
                    "them, interleaved, so a before/after lands in one run on one machine")
    ap.add_argument("--rounds", type=int, default=1, help="run the policies this many times, "
                    "interleaved (the machine's load drifts)")
    ap.add_argument("--worker-threads", type=int, default=1,
                    help="torch threads of the CPU worker (1: steady timings on a shared box)")
    ap.add_argument("--write", default=section_path("flood"),
                    help="append the table to PATH ('' to skip)")
    args = ap.parse_args()
    if args.small:
        return small(args)
    if args.flood:
        return flood(args)

    import torch

    sys.path.insert(0, str(HERE))
    from bench_engine import build_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.seq = args.seq or (512 if device == "cuda" else 64)
    work = Path(tempfile.mkdtemp(prefix="bench_flood_"))
    model_dir = work / "model"
    vocab = build_model(args.shape, model_dir, torch.bfloat16 if device == "cuda"
                        else torch.float32, device)
    results = []
    trees = ["", *filter(None, args.trees.split(","))]
    runs = [(t, tree) for t in args.policies.split(",") for tree in trees] * args.rounds
    for i, (target, tree) in enumerate(runs):
        toml = '"auto"' if target == "auto" else str(float(target))
        r = run_policy(model_dir, vocab, device, toml, args, work / f"run{i}", tree)
        r["target"], r["tree"] = target, tree
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k not in ("alone", "together")}),
              flush=True)
    text = report(results, args, device)
    print(text)
    if args.write:
        path = Path(args.write)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write("\n" + text)
        print(f"appended to {path}")


if __name__ == "__main__":
    main()
