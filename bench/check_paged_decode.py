"""The paged decode kernel on a GPU: compiled, against the gather + SDPA reference (fp32 and
bf16, eagerly and replayed in a CUDA graph after its inputs changed), then one layer's decode
attention timed both ways, with the kernel's tile size, warps and pipeline stages varied.
`--cascade`: the same checks and timings of the cascade (a fan-out's shared prompt read once
per group, paged_decode.prefix_groups) against the flat kernel and the reference.

    python bench/check_paged_decode.py                 # Qwen3-8B and Qwen2.5-0.5B head layouts
    python bench/check_paged_decode.py --cascade --shape qwen3-8b
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from twinkled.engine.kernels import paged_decode as pd
from twinkled.engine.kernels.paged_decode import members, paged_decode, prefix_groups, split_plan
from twinkled.engine.kv_pages import PagePool

DEV = "cuda"
SHAPES = {"qwen3-8b": (32, 8, 128), "qwen2.5-0.5b": (14, 2, 64)}  # heads, kv heads, dim


def make(rows: int, tokens: int, heads: int, kv: int, dim: int, page: int, dtype, seed=0):
    """A pool holding `rows` rows of up to `tokens` tokens (the first half of every 8 rows'
    pages shared, as a fan-out's prompt), their tables, lengths and one new token each."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    per = tokens // page
    pool = PagePool(1, kv, dim, rows * per + 1, page, dtype, torch.device(DEV))
    for t in (pool.k, pool.v):
        t.copy_(torch.randn(t.shape, generator=gen, device=DEV))
    table = 1 + torch.arange(rows * per, device=DEV).view(rows, per)
    table[:, :per // 2] = table[(torch.arange(rows, device=DEV) // 8) * 8, :per // 2]
    lengths = torch.randint(1, tokens + 1, (rows,), generator=gen, device=DEV)
    lengths[-1] = 1
    table[-1] = 0  # an inert padding row
    q, k, v = (torch.randn(rows, h, 1, dim, generator=gen, device=DEV, dtype=dtype)
               for h in (heads, kv, kv))
    return pool, table, lengths, q, k, v


def write_slots(pool, table, lengths):
    pos = lengths - 1
    return table.gather(1, (pos // pool.page_size)[:, None])[:, 0] * pool.page_size + \
        pos % pool.page_size


def old(pool, table, lengths, q, k, v, scale):
    keys, values = pool.view(write_slots(pool, table, lengths), table).write(0, k, v)
    mask = (torch.arange(keys.shape[2], device=DEV)[None] < lengths[:, None])[:, None, None]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def new(pool, table, lengths, q, k, v, scale, block_n=64, warps=4, stages=3, prefix=None):
    view = pool.view(write_slots(pool, table, lengths), table, lengths)
    view.store(0, k, v)
    return paged_decode(q[:, :, 0], pool.k[0], pool.v[0], table, lengths, pool.page_size,
                        scale, block_n, warps, stages, prefix)[:, :, None]


def fanout(rows: int, group: int, prompt: int, own: int, heads: int, kv: int, dim: int,
           dtype, seed=0):
    """A fan-out: every `group` rows share a `prompt`-token prefix (whole pages of 16) and
    hold up to `own` tokens more each; the groups and shared tokens of prefix_groups."""
    page = 16
    gen = torch.Generator(device=DEV).manual_seed(seed)
    shared, per = prompt // page, own // page
    groups = -(-rows // group)
    pool = PagePool(1, kv, dim, groups * shared + rows * per + 1, page, dtype, torch.device(DEV))
    for t in (pool.k, pool.v):
        t.copy_(torch.randn(t.shape, generator=gen, device=DEV))
    gid = torch.arange(rows, device=DEV) // group
    own_pages = 1 + groups * shared + torch.arange(rows * per, device=DEV).view(rows, per)
    table = torch.cat([1 + gid[:, None] * shared + torch.arange(shared, device=DEV), own_pages], 1)
    lengths = prompt + torch.randint(1, own + 1, (rows,), generator=gen, device=DEV)
    q, k, v = (torch.randn(rows, h, 1, dim, generator=gen, device=DEV, dtype=dtype)
               for h in (heads, kv, kv))
    pre = torch.full((rows,), prompt if group > 1 else 0, device=DEV)
    return (pool, table, lengths, q, k, v), (gid, pre)


def check_cascade(shape: str) -> None:
    """Cascade against the reference: fp32 and bf16, groups of 8, 3 and 1 (sharing nothing),
    and in a CUDA graph (prefix_groups inside it) replayed after the groups changed."""
    heads, kv, dim = SHAPES[shape]
    chunk = members(heads, kv)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        for rows, group in ((256, 8), (40, 3), (33, 1)):
            case, (gid, pre) = fanout(rows, group, 512, 256, heads, kv, dim, dtype)
            want = old(*case, dim**-0.5).float()
            got = new(*case, dim**-0.5, prefix=prefix_groups(gid, pre, chunk)).float()
            err = (got - want).abs().max().item()
            print(f"cascade {shape} {dtype} rows {rows} groups of {group}: max err {err:.2e}")
            assert err < tol, err
        case, (gid, pre) = fanout(64, 8, 256, 256, heads, kv, dim, dtype, seed=1)

        def step(case=case, gid=gid, pre=pre):
            return new(*case, dim**-0.5, prefix=prefix_groups(gid, pre, chunk))

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        perm = torch.randperm(64, device=DEV)  # rows moved: groups no longer adjacent
        for t in (*case[1:], gid):
            t.copy_(t[perm])
        pre[::5] = 0  # and some rows share nothing (always true)
        graph.replay()
        want = old(*case, dim**-0.5).float()
        err = (out.float() - want).abs().max().item()
        print(f"cascade {shape} {dtype} CUDA graph replay, rows moved: max err {err:.2e}")
        assert err < tol, err


def bench_cascade(shape: str, rows: int, group: int, prompt: int = 512, own: int = 256) -> None:
    """One layer's decode attention of a fan-out, flat kernel against the cascade."""
    heads, kv, dim = SHAPES[shape]
    case, (gid, pre) = fanout(rows, group, prompt, own, heads, kv, dim, torch.bfloat16)
    flat_gb = case[2].sum().item() * kv * dim * 2 * 2 / 1e9
    prefix = prefix_groups(gid, pre, members(heads, kv))
    ms_flat = timed(lambda: new(*case, 0.1))
    ms_casc = timed(lambda: new(*case, 0.1, prefix=prefix_groups(gid, pre, members(heads, kv))))
    ms_pre = timed(lambda: new(*case, 0.1, prefix=prefix))
    print(f"cascade {shape} rows {rows} groups of {group}, {prompt} + up to {own}: flat "
          f"{ms_flat:.3f} ms ({flat_gb / ms_flat * 1e3:.0f} GB/s of rows' KV), cascade "
          f"{ms_casc:.3f} ms ({ms_pre:.3f} without the chunking)", flush=True)


def check(shape: str) -> None:
    heads, kv, dim = SHAPES[shape]
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        for rows, tokens in ((256, 768), (5, 4096), (33, 160)):
            pool, table, lengths, q, k, v = make(rows, tokens, heads, kv, dim, 16, dtype)
            want = old(pool, table, lengths, q, k, v, dim**-0.5).float()
            got = new(pool, table, lengths, q, k, v, dim**-0.5).float()
            err = (got - want).abs().max().item()
            print(f"{shape} {dtype} rows {rows} tokens {tokens} "
                  f"splits {split_plan(rows, kv, tokens, q.device)}: max err {err:.2e}")
            assert err < tol, err
        # in a CUDA graph, replayed after the lengths, tables and query changed in place
        pool, table, lengths, q, k, v = make(64, 512, heads, kv, dim, 16, dtype, seed=1)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            new(pool, table, lengths, q, k, v, dim**-0.5)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = new(pool, table, lengths, q, k, v, dim**-0.5)
        _, table2, lengths2, q2, k2, v2 = make(64, 512, heads, kv, dim, 16, dtype, seed=2)
        for a, b in ((table, table2), (lengths, lengths2), (q, q2), (k, k2), (v, v2)):
            a.copy_(b)
        graph.replay()
        want = old(pool, table, lengths, q, k, v, dim**-0.5).float()
        err = (out.float() - want).abs().max().item()
        print(f"{shape} {dtype} CUDA graph replay: max err {err:.2e}")
        assert err < tol, err


def timed(fn, reps=50) -> float:
    """Median ms of `fn` replayed in a CUDA graph (as the decode step runs it)."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def bench(shape: str, rows: int, tokens: int) -> None:
    """One layer's decode attention, old path against the kernel under each tuning."""
    heads, kv, dim = SHAPES[shape]
    case = make(rows, tokens, heads, kv, dim, 16, torch.bfloat16)
    moved = case[2].sum().item() * kv * dim * 2 * 2 / 1e9  # GB of KV a layer reads

    def rate(ms: float) -> str:
        return f"{ms:.3f} ms ({moved / ms * 1e3:.0f} GB/s)"

    print(f"{shape} rows {rows} tokens {tokens} (mean {case[2].float().mean():.0f}): old "
          + rate(timed(lambda: old(*case, 0.1))), flush=True)
    for block_n in (32, 64, 128):
        line = f"  tile {block_n}:"
        for warps in (4, 8):
            for stages in (1, 3):
                ms = timed(lambda b=block_n, w=warps, st=stages: new(*case, 0.1, b, w, st))
                line += f" | warps {warps} stages {stages}: {rate(ms)}"
        print(line, flush=True)


SWEEP = {"suffix_stages": (1, 2, 3), "prefix_stages": (1, 2, 3), "prefix_fill": (1, 2, 4, 8),
         "prefix_block_n": (32, 64, 128), "prefix_warps": (4, 8)}


def sweep(shape: str, rows: int = 256, group: int = 8) -> dict:
    """The cascade's launch knobs (paged_decode.TUNE), one at a time from the defaults,
    each kept at its fastest on a fan-out layer; returns the tuning it settles on."""
    heads, kv, dim = SHAPES[shape]
    case, (gid, pre) = fanout(rows, group, 512, 256, heads, kv, dim, torch.bfloat16)
    prefix = prefix_groups(gid, pre, members(heads, kv))
    for key, values in SWEEP.items():
        times = {}
        for value in values:
            pd.TUNE[key] = value
            try:
                times[value] = timed(lambda: new(*case, 0.1, prefix=prefix))
            except Exception as e:  # e.g. out of shared memory: not a candidate
                print(f"  {key}={value}: {type(e).__name__}", flush=True)
        pd.TUNE[key] = min(times, key=times.get)
        print(f"sweep {shape} {key}: " + ", ".join(f"{v}: {t:.3f} ms" for v, t in times.items())
              + f" -> {pd.TUNE[key]}", flush=True)
    return dict(pd.TUNE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES))
    ap.add_argument("--time", action="append", choices=sorted(SHAPES),
                    help="shapes to time (default: those checked)")
    ap.add_argument("--cascade", action="store_true", help="check and time the cascade only")
    ap.add_argument("--sweep", default=None,
                    help="with --cascade: sweep its launch knobs first, write the best (JSON) here")
    args = ap.parse_args()
    print(torch.cuda.get_device_name())
    if args.cascade:
        for shape in args.shape or sorted(SHAPES):
            if args.sweep:
                best = sweep(shape)
                print(f"best {json.dumps(best)}")
                with open(args.sweep, "w") as f:
                    json.dump(best, f)
            check_cascade(shape)
            for rows, group in ((256, 8), (256, 1), (64, 8), (32, 8)):
                bench_cascade(shape, rows, group)
        return
    for shape in args.shape or sorted(SHAPES):
        check(shape)
    for shape in args.time or args.shape or sorted(SHAPES):
        bench(shape, 256, 768)
        bench(shape, 32, 4096)


if __name__ == "__main__":
    main()
