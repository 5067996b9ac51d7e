"""What durability costs: 8 tenants through the daemon, persistence on against off.

With persistence on (`persist_every = 1`, the default) every optimizer step appends the ops
that change an adapter to its journal (`twinkled/core/journal.py`) before it is acknowledged, and
the workers write adapter state behind the training loop (`twinkled/workers/persist.py`).
With `persist_every = 0` neither happens. The same tinker tenants as bench_multitenant.py
(1 x S random tokens per step each) run against a fresh daemon and data dir per run, in the
order off, on, off, on, ... so that drift of the machine shows. For every run it reports
tokens/s and step p50/p99; for the runs with persistence on, also what is left under
data_dir/live: its size and the journals' files, records and bytes, at the end of the timed
steps (daemon running) and after the daemon's shutdown, which shows the journal is compacted.
Target: on / off >= 0.90 in tokens/s.

    python bench/bench_persistence.py --shape qwen2.5-0.5b              # GPU
    python bench/bench_persistence.py --shape tiny --devices cpu        # CPU, seconds
    python bench/bench_persistence.py --fsync     # persistence on, the journal's fsync off/on
"""

from __future__ import annotations

import argparse
import statistics
import struct
import sys
import tempfile
import threading
from pathlib import Path

from output import section_path  # bench/ is the script's directory

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_multitenant import make_keys, pct, run_tenants, start_daemon  # noqa: E402

JOURNAL = ".journal"  # twinkled.core.journal.FILE
_LEN = struct.Struct("<I")  # each record: a little-endian u32 length, then msgpack


def live_stats(data: Path) -> dict:
    """Size of data/live, and its journals: files, records and bytes."""
    live = data / "live"
    files = [p for p in live.rglob("*") if p.is_file()] if live.is_dir() else []
    journals = [p for p in files if p.name == JOURNAL]
    records = 0
    for p in journals:
        raw = p.read_bytes()
        off = 0
        while off + _LEN.size <= len(raw):
            (n,) = _LEN.unpack_from(raw, off)
            off += _LEN.size + n
            records += 1
    return {"bytes": sum(p.stat().st_size for p in files), "journals": len(journals),
            "records": records, "journal_bytes": sum(p.stat().st_size for p in journals)}


class Sampler(threading.Thread):
    """live_stats of a data dir every `every` s while the tenants train: the peak of each."""

    def __init__(self, data: Path, every: float = 0.25):
        super().__init__(daemon=True)
        self.data, self.every, self.stop = data, every, threading.Event()
        self.peak = {"bytes": 0, "journals": 0, "records": 0, "journal_bytes": 0}
        self.samples = 0

    def run(self) -> None:
        while not self.stop.wait(self.every):
            try:
                s = live_stats(self.data)
            except OSError:  # a file replaced under us (compaction, a new version)
                continue
            self.samples += 1
            self.peak = {k: max(v, s[k]) for k, v in self.peak.items()}


def one_run(label: str, every: int, i: int, work: Path, model_dir: Path, vocab: int,
            device: str, tenants: int, seq: int, steps: int, fsync: bool | None = None) -> dict:
    data = work / f"data_{label}{i}"
    config = work / f"persist_every_{every}_{fsync}.toml"
    config.write_text(f"persist_every = {every}\n" + (
        "" if fsync is None else f"journal_fsync = {str(fsync).lower()}\n"))
    keys = make_keys(data, tenants)
    daemon, url, log = start_daemon(model_dir, data, work, device, "--config", str(config))
    sampler = Sampler(data)
    sampler.start()
    try:
        res = run_tenants(url, keys, model_dir.name, vocab, seq, steps, [1] * tenants)
        sampler.stop.set()
        sampler.join()
        running = live_stats(data)
    finally:
        sampler.stop.set()
        daemon.terminate()
        daemon.wait(timeout=180)
        log.close()
    stopped = live_stats(data)
    wall = max(r["t1"] for r in res) - min(r["t0"] for r in res)
    lat = [x for r in res for x in r["lat"]]
    row = {"label": label, "every": every, "tps": sum(r["tokens"] for r in res) / wall,
           "p50": pct(lat, 0.5), "p99": pct(lat, 0.99), "peak": sampler.peak,
           "samples": sampler.samples, "running": running, "stopped": stopped}
    print(f"run {label} #{i + 1}: {row['tps']:,.0f} tok/s, p50 {row['p50']:.3f} s, "
          f"p99 {row['p99']:.3f} s; live: peak {sampler.peak} over {sampler.samples} samples, "
          f"at the end {running}, after shutdown {stopped}", flush=True)
    return row


def mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default=None, help="cpu, cuda or cuda:N (default: cuda if any)")
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=("tiny", "qwen2.5-0.5b", "qwen3-8b"))
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--seq", type=int, default=None, help="tokens per datum (512 GPU, 64 CPU)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (20 GPU, 6 CPU)")
    ap.add_argument("--repeats", type=int, default=2, help="off/on pairs, interleaved")
    ap.add_argument("--write", default=section_path("persistence"), help="append the section here ('' to skip)")
    ap.add_argument("--fsync", action="store_true",
                    help="persistence on in every run; compare the journal's fsync off/on")
    args = ap.parse_args()

    import torch
    from bench_engine import build_model, header

    device = args.devices or ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.startswith("cuda")
    dtype = torch.bfloat16 if gpu else torch.float32
    seq = args.seq or (512 if gpu else 64)
    steps = args.steps or (20 if gpu else 6)
    work = Path(tempfile.mkdtemp(prefix="bench_persist_"))
    model_dir = work / "model"
    vocab = build_model(args.shape, model_dir, dtype, device)
    torch.cuda.empty_cache() if gpu else None

    rows = []
    try:
        for i in range(args.repeats):
            for label, every in (("off", 0), ("on", 1)):
                fsync = (label == "on") if args.fsync else None
                rows.append(one_run(label, every or int(args.fsync), i, work, model_dir, vocab,
                                    device, args.tenants, seq, steps, fsync))
    except BaseException:
        logf = work / "twinkled.log"
        if logf.exists():
            tail = logf.read_bytes().decode(errors="replace").splitlines()[-80:]
            print("--- twinkled.log (tail) ---\n" + "\n".join(tail), file=sys.stderr)
        raise

    off = [r for r in rows if r["label"] == "off"]
    on = [r for r in rows if r["label"] == "on"]
    mean = statistics.fmean
    ratio = mean(r["tps"] for r in on) / mean(r["tps"] for r in off)
    pairs = [b["tps"] / a["tps"] for a, b in zip(off, on, strict=True)]

    what = "the journal's fsync" if args.fsync else "persistence"
    text = header("cuda" if gpu else "cpu").replace("Engine vs peft", f"Durability cost: {what} on vs off")
    text += (f"\n### {args.shape} ({device}, {str(dtype).split('.')[-1]}, LoRA r=32 on all linear "
             f"layers, {args.tenants} tenants at 1 x S each, S={seq}, {steps} timed steps per "
             f"tenant, unmodified tinker 0.38 clients; a fresh daemon and data dir per run, in "
             f"this order)\n\n"
             f"| run | {what} | tokens/s | step p50 (s) | step p99 (s) |\n"
             "|---:|---|---:|---:|---:|\n")
    for n, r in enumerate(rows, 1):
        if args.fsync:
            how = f"{r['label']} (`journal_fsync = {str(r['label'] == 'on').lower()}`)"
        else:
            how = "on (`persist_every = 1`)" if r["every"] else "off (`persist_every = 0`)"
        text += f"| {n} | {how} | {r['tps']:,.0f} | {r['p50']:.3f} | {r['p99']:.3f} |\n"
    text += (f"| mean | off | {mean(r['tps'] for r in off):,.0f} | "
             f"{mean(r['p50'] for r in off):.3f} | {mean(r['p99'] for r in off):.3f} |\n"
             f"| mean | on | {mean(r['tps'] for r in on):,.0f} | "
             f"{mean(r['p50'] for r in on):.3f} | {mean(r['p99'] for r in on):.3f} |\n")
    text += (f"\nOn / off, tokens/s: **{ratio:.2f}** (mean of the runs; target >= 0.90); each pair: "
             f"{', '.join(f'{p:.2f}' for p in pairs)}. Step p50 on / off: "
             f"{mean(r['p50'] for r in on) / mean(r['p50'] for r in off):.2f}, p99: "
             f"{mean(r['p99'] for r in on) / mean(r['p99'] for r in off):.2f}.\n")
    text += ("\ndata_dir/live with persistence on (journals: the `.journal` files, their records "
             "and bytes): the peak of each, sampled every 0.25 s from the tenants' start to "
             "their end, then what is left once the tenants are done (the daemon running), "
             "and after its shutdown:\n\n| run | persistence | when | live/ (MiB) | journals | "
             "records | journal bytes |\n|---:|---|---|---:|---:|---:|---:|\n")
    for n, r in enumerate(rows, 1):
        if not r["every"]:
            continue
        state = f"fsync {r['label']}" if args.fsync else "on"
        for when, name in (("peak", f"peak while training ({r['samples']} samples)"),
                           ("running", "after the steps"), ("stopped", "after shutdown")):
            s = r[when]
            text += (f"| {n} | {state} | {name} | {mib(s['bytes'])} | {s['journals']} | "
                     f"{s['records']} | {s['journal_bytes']:,} |\n")
    o = max(r["peak"]["journals"] for r in off)
    text += "\n" if args.fsync else (f"\nWith persistence off, at most {o} journal(s) were seen under live/ (its peak: "
             f"{mib(max(r['peak']['bytes'] for r in off))} MiB). ")
    text += ("Each tenant "
             f"ran 2 warm-up and "
             f"{steps} timed steps (forward_backward + optim_step each).\n")
    print(text)
    if args.write:
        with Path(args.write).open("a") as f:
            f.write("\n" + text)
        print(f"appended to {args.write}")


if __name__ == "__main__":
    main()
