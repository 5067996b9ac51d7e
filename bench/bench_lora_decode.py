"""Multi-LoRA decode on the GPU: the masked stack (lora_rows.RowLora: every row x every
adapter's columns) against the row kernels (kernels/lora_decode.py: every row x its own
adapter's columns), on one decode step's LoRA work.

--check: the kernels against the masked path on CUDA (fp32 and bf16, eager and replayed
from a CUDA graph after the row buffers changed), then a tiny model's running batch with
the kernels on and off (decode "graphs"): the share of equal tokens and the logprob gap.
The timing: the LoRA deltas of all 7 target modules x `--layers` layers at a model's module
sizes (default the 8B's: hidden 4096, kv 1024, intermediate 12288) for `--rows` rows spread
evenly over N adapters of rank `--rank`, each path captured in one CUDA graph, median of
replays; the base linears of the same modules timed the same way, for scale.

    python bench/bench_lora_decode.py --check --adapters 8,64
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import torch
import torch.nn.functional as F

from twinkled.engine.kernels import lora_decode

SHAPES = {"8b": (4096, 1024, 12288), "0.5b": (896, 128, 4864)}


def modules(hidden: int, kv: int, inter: int) -> list[tuple[int, int]]:
    return [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden),
            (hidden, inter), (hidden, inter), (inter, hidden)]


def rows_of(n: int, adapters: int, rank: int, dev) -> tuple[torch.Tensor, ...]:
    ad = torch.arange(n, device=dev) % adapters
    ad = ad[torch.randperm(n, device=dev)]  # slots in no adapter order, as rows come and go
    start = (ad * rank).int()
    return start, torch.full((n,), rank, dtype=torch.int32, device=dev), \
        torch.full((n,), 2.0, device=dev)


def masked(start, rank, scale, width, dtype):
    cols = torch.arange(width, device=start.device)
    inside = (cols[None] >= start[:, None]) & (cols[None] < (start + rank)[:, None])
    return (inside * scale[:, None]).to(dtype)


def graph_time(fn, reps: int = 20) -> float:
    """Median ms of one replay of fn captured in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times[3:])


# Knobs of kernels/lora_decode.py the timing tries (name -> module attributes); the first
# is the module's default.
# "before": the kernels before PARTIALS and NB (a chunk a partial sum, a tile a program).
VARIANTS = {"default": {}, "while": {"DYN_FOR": False}, "before": {"PARTIALS": 1 << 30, "NB": 1},
            "nb1": {"NB": 1}, "nb4": {"NB": 4}, "partials4": {"PARTIALS": 4},
            "partials16": {"PARTIALS": 16}, "chunk512": {"CHUNK": {2: 512, 4: 256}},
            "chunk128": {"CHUNK": {2: 128, 4: 64}}, "bn64": {"BN": 64}, "bn256": {"BN": 256}}


def variant(name: str) -> dict:
    """Set a variant's knobs; returns the previous values."""
    old = {k: getattr(lora_decode, k) for k in VARIANTS[name]}
    for k, v in VARIANTS[name].items():
        setattr(lora_decode, k, v)
    return old


def check_kernels(dev) -> dict:
    gen = torch.Generator(device=dev).manual_seed(0)
    out = {}
    for name in ("default", "while"):
        old = variant(name)
        try:
            out[name] = {str(dtype): _check_dtype(dtype, tol, dev, gen)
                         for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2))}
        except Exception as e:  # noqa: BLE001 - report it, and go on to the next
            out[name] = repr(e)[:400]
        for k, v in old.items():
            setattr(lora_decode, k, v)
    return out


def _check_dtype(dtype, tol: float, dev, gen) -> dict:
    n, k, o, w = 77, 4096, 1024 + 40, 256
    x = torch.randn((n, k), device=dev, generator=gen).to(dtype)
    A = (torch.randn((w, k), device=dev, generator=gen) / k ** 0.5).to(dtype)
    B = (torch.randn((o, w), device=dev, generator=gen) / 8).to(dtype)
    y0 = torch.randn((n, o), device=dev, generator=gen).to(dtype)
    bufs = [torch.zeros(n, dtype=torch.int32, device=dev),
            torch.zeros(n, dtype=torch.int32, device=dev), torch.zeros(n, device=dev)]
    y = y0.clone()

    def step():
        y.copy_(y0)
        lora_decode.apply(lora_decode.plan(*bufs), x, A, B, y, 64)

    errs = []
    for trial, (ads, rank) in enumerate(((5, 24), (3, 64), (40, 5))):
        s, r, c = rows_of(n, ads, rank, dev)
        r[::7] = 0  # base-model rows
        for buf, v in zip(bufs, (s, r, c), strict=True):
            buf.copy_(v)
        want = y0.float() + (F.linear(x, A) * masked(s, r, c, w, dtype)).float() @ B.float().T
        if trial == 0:
            step()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step()
        g.replay()  # the graph reads the buffers: new rows, no recapture
        torch.cuda.synchronize()
        errs.append(((y.float() - want).abs().max() / want.abs().max()).item())
    return {"max_rel_err": max(errs), "ok": max(errs) < tol}


def check_batch(dev, requests: int = 12, new: int = 24) -> dict:
    """A tiny model's running batch, decode "graphs", kernels on vs off."""
    from twinkled.engine.engine import Engine
    from twinkled.engine.running import RunningBatch
    from twinkled.engine.sampler import generate
    from twinkled.engine.tiny import build_tiny_model
    from twinkled.protocol.types import LoraConfig, SampleRequest, SamplingParams

    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(f"{tmp}/tiny")
        for dtype in ("float32", "bfloat16"):
            e = Engine(path, device=dev, dtype=dtype)
            for i, rank in enumerate((4, 20, 64)):
                e.add_adapter(f"a{i}", LoraConfig(rank=rank, alpha=rank, seed=i))
                with torch.no_grad():
                    ad = e.pool.get(f"a{i}")
                    for key in ad.bank.shapes:
                        ad.bank.B[key][ad.slot].normal_(0, 0.3)
                    ad.bank.stale.add(ad.slot)
            gen = torch.Generator().manual_seed(0)
            reqs = [SampleRequest([None, "a0", "a1", "a2"][i % 4],
                                  torch.randint(5, 1000, (5 + i,), generator=gen).tolist(),
                                  SamplingParams(max_tokens=new, seed=i, stop=[]), num_samples=3)
                    for i in range(requests)]
            ads = [None if r.adapter_id is None else e.pool.get(r.adapter_id) for r in reqs]
            got = {}
            for kernels in (False, True):
                batch = RunningBatch(e.model, rows=64, kernels=kernels)  # CUDA: graphs
                got[kernels] = generate(e.model, reqs, ads, batch=batch)
            same = total = 0
            gap = 0.0
            for a, b in zip(got[True], got[False], strict=True):
                for x, y in zip(a.sequences, b.sequences, strict=True):
                    total += 1
                    same += x.tokens == y.tokens
                    if x.tokens == y.tokens:
                        gap = max([gap, *(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True))])
            res[dtype] = {"equal_sequences": f"{same}/{total}", "max_logprob_gap": gap}
    return res


def bench(args, dev) -> list[dict]:
    dtype = torch.bfloat16
    mods = modules(*SHAPES[args.shape])
    n = args.rows
    x = {k: torch.randn((n, k), device=dev, dtype=dtype) for k in {k for k, _ in mods}}
    y = {o: torch.zeros((n, o), device=dev, dtype=dtype) for o in {o for _, o in mods}}
    rows = [{"path": "base linears (for scale)", "ms": _time_base(args.layers, mods, x, y, dev)}]
    print(rows[-1], flush=True)
    for adapters in args.adapters:
        rows += _time_paths(adapters, args, mods, x, y, dev)
        torch.cuda.empty_cache()
    return rows


def _time_base(layers: int, mods, x, y, dev) -> float:
    base = [torch.randn((o, k), device=dev, dtype=torch.bfloat16) / 64 for _ in range(layers)
            for k, o in mods]
    return round(graph_time(lambda: _base_step(base, mods, x, y)), 3)


def _base_step(base, mods, x, y) -> None:
    for i, wgt in enumerate(base):
        k, o = mods[i % len(mods)]
        torch.mm(x[k], wgt.t(), out=y[o])


def _masked_step(stacks, mods, x, y, mask) -> None:
    for i, (A, B) in enumerate(stacks):
        k, o = mods[i % len(mods)]
        h = F.linear(x[k], A) * mask
        y[o].addmm_(h, B.t())


def _kernel_step(stacks, mods, x, y, rows, rb) -> None:
    p = lora_decode.plan(*rows)
    for i, (A, B) in enumerate(stacks):
        k, o = mods[i % len(mods)]
        lora_decode.apply(p, x[k], A, B, y[o], rb)


GROUPS = [(0, 1, 2), (3,), (4, 5), (6,)]  # a layer's modules that read one x: q/k/v, gate/up


def _grouped_step(stacks, mods, x, joint, rows, rb) -> None:
    """The kernels as a decode step runs them since apply_group: one launch pair for q/k/v
    and one for gate/up, their outputs views of one joint output each (fused_ops.Joint)."""
    p = lora_decode.plan(*rows)
    for layer in range(len(stacks) // len(mods)):
        for g in GROUPS:
            k = mods[g[0]][0]
            ys = joint[g].split([mods[i][1] for i in g], dim=1)
            lora_decode.apply_group(p, x[k], [stacks[layer * len(mods) + i][0] for i in g],
                                    [stacks[layer * len(mods) + i][1] for i in g], list(ys), rb)


def _time_paths(adapters: int, args, mods, x, y, dev) -> list[dict]:
    dtype, n, rank = torch.bfloat16, args.rows, args.rank
    width = adapters * rank
    stacks = [(torch.randn((width, k), device=dev, dtype=dtype) / 64,
               torch.randn((o, width), device=dev, dtype=dtype) / 64)
              for _ in range(args.layers) for k, o in mods]
    rows = rows_of(n, adapters, rank, dev)
    mask = masked(*rows, width, dtype)
    rb = lora_decode.rank_block(rank)
    gb = sum(A.numel() + B.numel() for A, B in stacks) * 2 / 1e9
    ms = graph_time(lambda: _masked_step(stacks, mods, x, y, mask))
    out = [{"path": "masked", "adapters": adapters, "ms": round(ms, 3), "adapter_GB": round(gb, 2),
            "GB/s": round(gb / ms * 1e3, 1)}]
    print(out[-1], flush=True)
    ms = graph_time(lambda: _kernel_step(stacks, mods, x, y, rows, rb))
    out.append({"path": "kernels, a launch pair a module", "adapters": adapters,
                "ms": round(ms, 3), "GB/s": round(gb / ms * 1e3, 1)})
    print(out[-1], flush=True)
    # the variants as a decode step runs them: grouped (q/k/v, gate/up: one launch pair each)
    joint = {g: torch.zeros((n, sum(mods[i][1] for i in g)), device=dev, dtype=dtype)
             for g in GROUPS}
    for name in (v for v in VARIANTS if v != "while"):
        old = variant(name)
        try:
            ms = graph_time(lambda: _grouped_step(stacks, mods, x, joint, rows, rb))
            out.append({"path": f"kernels grouped, {name}", "adapters": adapters,
                        "ms": round(ms, 3), "GB/s": round(gb / ms * 1e3, 1)})
        except Exception as e:  # noqa: BLE001 - report it, and go on to the next
            out.append({"path": f"kernels grouped, {name}", "adapters": adapters,
                        "error": repr(e)[:400]})
        for k, v in old.items():
            setattr(lora_decode, k, v)
        print(out[-1], flush=True)
    if adapters == max(args.adapters):
        out += _time_prefill(stacks[:4 * len(mods)], mods, adapters, rank, width, dev)
    return out


def _time_prefill(stacks, mods, adapters: int, rank: int, width: int, dev) -> list[dict]:
    """A prefill's LoRA work (4 layers): 16 prompts of 256 tokens, each of its own adapter."""
    dtype, n = torch.bfloat16, 16 * 256
    rows = [t.repeat_interleave(256) for t in rows_of(16, min(adapters, 16), rank, dev)]
    mask = masked(*rows, width, dtype)
    x = {k: torch.randn((n, k), device=dev, dtype=dtype) for k in {k for k, _ in mods}}
    y = {o: torch.zeros((n, o), device=dev, dtype=dtype) for o in {o for _, o in mods}}
    rb = lora_decode.rank_block(rank)
    out = []
    for name, fn, knobs in (("masked", lambda: _masked_step(stacks, mods, x, y, mask), None),
                            ("kernels", lambda: _kernel_step(stacks, mods, x, y, rows, rb), None),
                            ("kernels before", lambda: _kernel_step(stacks, mods, x, y, rows, rb),
                             "before")):
        old = variant(knobs) if knobs else {}
        out.append({"path": f"prefill 4096 tokens, 4 layers, {name}", "adapters": adapters,
                    "ms": round(graph_time(fn), 3)})
        for k, v in old.items():
            setattr(lora_decode, k, v)
        print(out[-1], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--adapters", default="8,64", type=lambda s: [int(v) for v in s.split(",")])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    report = {"card": torch.cuda.get_device_name(), "args": vars(args)}
    if args.check:
        report["kernels"] = check_kernels(dev)
        print(report["kernels"], flush=True)
        report["running_batch"] = check_batch(dev)
        print(report["running_batch"], flush=True)
    report["timing"] = bench(args, dev)
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
