"""The journal's group commit: how long a step waits for its journal to reach the disk.

Every step that changes adapters appends one record to each adapter's journal and fsyncs
those files before any client hears its op is done (twinkled/core/journal.py). This times
`Journal.flush` for steps touching 1, 8 and 32 adapters, with the fsyncs one after another
(`sync_threads = 1`, the code before) and at once (the default), alternating, in one run, on
the disk that holds `--dir` (default: the system's temporary folder; point it at the data
dir's disk to measure that one). `--background-mb N` keeps a thread writing N MiB files
and fsyncing each meanwhile, as the workers' persister writes adapter states (where the
GPU machines' journal commits waited 0.3-2 s); `--background-fsyncs N` keeps N threads
appending 4 KiB and fsyncing, as other daemons' journals and databases on a shared disk do.
No GPU, no daemon.

    python bench/bench_journal.py
    python bench/bench_journal.py --dir /var/lib/twinkle --steps 100 --background-mb 1024
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

from output import emit, section_path

from twinkled.core.journal import Journal

RECORD = b"x" * 1500  # about a forward_backward frame of a few datums


def time_flushes(folder: Path, adapters: int, threads: int, steps: int) -> list[float]:
    journal = Journal(folder, sync_threads=threads)
    times = []
    for step in range(1, steps + 2):  # the first step makes the files: not timed
        for a in range(adapters):
            journal.record(f"adapter-{a}", step, RECORD)
        t0 = time.perf_counter()
        asyncio.run(journal.flush())
        if step > 1:
            times.append(time.perf_counter() - t0)
    return times


class Writer(threading.Thread):
    """Writes `mb` MiB files in `folder` and fsyncs each, until stopped: the persister."""

    def __init__(self, folder: Path, mb: int):
        super().__init__(daemon=True)
        self.folder, self.mb, self.stop, self.written = folder, mb, threading.Event(), 0

    def run(self) -> None:
        block = os.urandom(1 << 20)
        while not self.stop.is_set():
            path = self.folder / "state.bin"
            with open(path, "wb") as f:
                for _ in range(self.mb):
                    f.write(block)
                f.flush()
                os.fsync(f.fileno())
            self.written += self.mb
            path.unlink()


class Syncer(threading.Thread):
    """Appends 4 KiB to a file of its own and fsyncs it, until stopped."""

    def __init__(self, path: Path, stop: threading.Event):
        super().__init__(daemon=True)
        self.path, self.stop = path, stop

    def run(self) -> None:
        while not self.stop.is_set():
            with open(self.path, "ab") as f:
                f.write(b"y" * 4096)
                f.flush()
                os.fsync(f.fileno())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="a folder on the disk to measure")
    ap.add_argument("--adapters", default="1,8,32")
    ap.add_argument("--steps", type=int, default=40, help="timed flushes a configuration")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the two ways")
    ap.add_argument("--background-mb", type=int, default=0,
                    help="a writer of files this large beside the journal (0: none)")
    ap.add_argument("--background-fsyncs", type=int, default=0,
                    help="threads appending 4 KiB and fsyncing beside the journal")
    ap.add_argument("--write", default=section_path("journal"))
    args = ap.parse_args()
    results: dict[tuple[int, int], list[float]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        writer = None
        if args.background_mb:
            writer = Writer(Path(tmp), args.background_mb)
            writer.start()
        quiet = threading.Event()
        syncers = [Syncer(Path(tmp) / f"other-{i}", quiet) for i in range(args.background_fsyncs)]
        for t in syncers:
            t.start()
        for r in range(args.rounds):
            for n in map(int, args.adapters.split(",")):
                for threads in (1, 8):
                    folder = Path(tmp) / f"r{r}-n{n}-t{threads}"
                    results.setdefault((n, threads), []).extend(
                        time_flushes(folder, n, threads, args.steps))
        quiet.set()
        for t in syncers:
            t.join()
        if writer is not None:
            writer.stop.set()
            writer.join()
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = (f"## The journal's group commit, {now}\n\n"
            f"- machine: {platform.node()} ({os.cpu_count()} CPUs); folder: {args.dir or tempfile.gettempdir()}\n"
            f"- command: `python {' '.join(sys.argv)}`\n\n"
            f"{args.rounds} x {args.steps} flushes a row, alternating; a record of "
            f"{len(RECORD)} bytes an adapter a step; "
            + (f"beside a writer of {args.background_mb} MiB files ({writer.written:,} MiB "
               "written)" if writer else "no large writer")
            + f", {args.background_fsyncs} threads appending 4 KiB + fsync\n\n"
            "| adapters a step | one after another p50 / p90 (ms) | at once p50 / p90 (ms) | p50 ratio |\n"
            "|---:|---|---|---:|\n")
    for n in map(int, args.adapters.split(",")):
        one, many = (sorted(results[n, t]) for t in (1, 8))
        p = [(statistics.median(x) * 1e3, x[int(0.9 * (len(x) - 1))] * 1e3) for x in (one, many)]
        text += (f"| {n} | {p[0][0]:.2f} / {p[0][1]:.2f} | {p[1][0]:.2f} / {p[1][1]:.2f} | "
                 f"{p[0][0] / max(p[1][0], 1e-6):.1f}x |\n")
    emit(text, args.write)


if __name__ == "__main__":
    main()
