"""What a move between the GPU bank and host memory costs the worker (workers/parked.py):
the time one park and one unpark of a rank-32 adapter take on the worker's thread (what a
step in flight waits for when the move joins it), split from the pinned allocation it needs.

Timed in one process, on the same adapters: pinned allocations of a parked state's size,
fresh and from torch's cache; parks into fresh host memory, unparks, parks again into
memory the unparks freed (a host tier without a budget: the path before the arena); then
parks into and unparks from the arena a worker's host tier pins ahead. Each is
device-synchronised.

    python bench/bench_park.py [--shape qwen2.5-0.5b] [--adapters 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_engine import build_model, header  # noqa: E402
from output import emit, section_path  # noqa: E402

from twinkled.engine.engine import Engine  # noqa: E402
from twinkled.engine.pinned import pinned_bytes  # noqa: E402
from twinkled.protocol.types import LoraConfig  # noqa: E402
from twinkled.workers.parked import HostTier  # noqa: E402


def timed(fn, n: int) -> list[float]:
    """ms of each of `n` calls of `fn(i)`, the device synchronised after each."""
    out = []
    for i in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn(i)
        torch.cuda.synchronize()
        out.append(1e3 * (time.perf_counter() - t))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--write", default=section_path("park"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        build_model(args.shape, Path(tmp) / "model", torch.bfloat16, "cuda")
        eng = Engine(Path(tmp) / "model", dtype=torch.bfloat16, device=torch.device("cuda"))
        names = [f"a{i}" for i in range(args.adapters)]
        for i, name in enumerate(names):
            eng.add_adapter(name, LoraConfig(rank=32, alpha=32, seed=i))
        a = eng.pool.get(names[0])
        state = a.bank.flat(a.slot, "w").nbytes * 3  # weights and two moments, fp32
        mb = state / 1e6
        held = []
        fresh = timed(lambda _: held.append(
            torch.empty(state, dtype=torch.uint8, pin_memory=True)), args.adapters)
        held.clear()  # (back to torch's cache)
        cached = timed(lambda _: held.append(
            torch.empty(state, dtype=torch.uint8, pin_memory=True)), args.adapters)
        rows += [("pinned allocation, fresh", fresh), ("pinned allocation, from the cache", cached)]
        held.clear()
        empty = getattr(torch._C, "_accelerator_emptyHostCache", None) or getattr(
            torch._C, "_host_emptyCache", lambda: None)
        empty()  # the parks below start from fresh memory again (where the build can)
        tier = HostTier(eng)

        def park(i: int) -> None:
            tier.park(names[i])
            tier.settle(wait=True)

        rows.append(("park, fresh host memory", timed(park, args.adapters)))
        rows.append(("unpark", timed(lambda i: tier.unpark(names[i]), args.adapters)))
        rows.append(("park again, memory the unparks freed", timed(park, args.adapters)))
        for i in range(args.adapters):
            tier.unpark(names[i])
        # What an unpark (and a load) spent before writing the state: a new adapter's A
        # drawn on the CPU and copied in, against a slot left zero
        config = eng.pool.get(names[0]).config
        for init, what in ((True, "a new bank slot, its A drawn (a create)"),
                           (False, "a new bank slot left zero (an unpark, a load)")):
            def add(i: int, init=init) -> None:
                eng.pool.add(f"x{i}", config, init=init)
            rows.append((what, timed(add, args.adapters)))
            for i in range(args.adapters):
                eng.remove_adapter(f"x{i}")
        # The host tier as a worker has it: its budget pinned ahead (engine/host_arena.py)
        t = time.perf_counter()
        tier = HostTier(eng, max_bytes=(args.adapters + 1) * state)
        tier.arena.wait_filled()
        made_s = time.perf_counter() - t
        rows.append(("park into the arena, made ahead", timed(park, args.adapters)))
        rows.append(("unpark from the arena", timed(lambda i: tier.unpark(names[i]),
                                                    args.adapters)))
    text = header("cuda").replace("Engine vs peft", "Parks between the GPU bank and host memory")
    text += (f"\n### {args.shape}, rank-32 adapters on every linear, {args.adapters} of them; "
             f"a parked state {mb:.0f} MB (pinned: {pinned_bytes(state) / 2**20:.0f} MiB); "
             f"the arena's {(args.adapters + 1) * mb / 1e3:.1f} GB made in {made_s:.1f} s\n\n"
             "| what | ms median | ms max | GB/s of the state |\n|---|---:|---:|---:|\n")
    for what, ms in rows:
        med = statistics.median(ms)
        text += f"| {what} | {med:.1f} | {max(ms):.1f} | {mb / med:.1f} |\n"
    emit(text, args.write)


if __name__ == "__main__":
    main()
