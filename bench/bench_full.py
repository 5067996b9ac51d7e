"""A full-parameter run (rank 0, twinkled/engine/full_param.py) against a plain PyTorch loop,
on the same card and the same random-weight checkpoint.

  ours:  Engine(dtype=bfloat16): bf16 weights for the passes, fp32 masters and AdamW
         moments, one `forward_backward` of B x S tokens + one `optim_step`;
  plain: the Hugging Face model in fp32 under bf16 autocast, summed token cross-entropy,
         torch.optim.AdamW (fused on CUDA): the usual mixed-precision loop.

With `--ranks N` (one process a GPU, as a lane of N GPUs): ours splits the fp32 masters
and moments over the ranks (ZeRO-1, the daemon's lane of N workers), plain is the HF model
under torch FSDP2 (`fully_shard` per decoder layer, bf16 params, fp32 reduce). Each rank
runs `--batch` rows; tok/s counts all ranks.

Rows: tokens/s (median of timed rounds after warm-up), MFU (6N FLOPs a trained token
against the cards' dense bf16 peak) and peak GPU memory (rank 0). A full run needs ~16
bytes a parameter on one GPU, so the 8B shape needs `--ranks 4` (4 + 12/4 bytes a
parameter each), or `--layers N` to cut its depth.

    python bench/bench_full.py --shape tiny --device cpu [--ranks 2]
    python bench/bench_full.py --shape qwen3-8b --layers 12 --seq 2048 --batch 2
    python bench/bench_full.py --shape qwen3-8b --ranks 4 --seq 2048 --batch 2

With `--daemon` the first row is the full run through a real `twinkled serve` and the
unmodified tinker client (full_daemon.py: how the lane is laid out), the daemon is stopped,
and the plain loop (FSDP2 with `--ranks N`) runs on the same checkpoint; the table adds
their ratio:

    python bench/bench_full.py --shape tiny --device cpu --ranks 2 --daemon
    python bench/bench_full.py --shape qwen3-8b --ranks 2 --daemon --seq 2048 --batch 2
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

import torch
from bench_engine import PEAK_BF16, Row, build_model, free, measure, seed_all
from full_daemon import daemon_row, layout_note
from output import emit, section_path

from twinkled.engine.engine import Engine
from twinkled.protocol.sizing import weight_bytes
from twinkled.protocol.types import AdamParams, Datum, ForwardBackwardRequest, LoraConfig

ADAM = AdamParams(learning_rate=1e-5, beta1=0.9, beta2=0.95, eps=1e-8)


def _mfu(row: Row, params: int, device: str, ranks: int) -> float | None:
    if not device.startswith("cuda"):
        return None
    peak = next((v for k, v in PEAK_BF16.items() if k in torch.cuda.get_device_name()), None)
    return None if peak is None else row.tokens / row.seconds * 6 * params / peak / ranks


def ours(model_dir: Path, device: str, batch: list[torch.Tensor], warmup: int,
         reps: int, group=None) -> Row:
    eng = Engine(model_dir, dtype="bfloat16" if device.startswith("cuda") else "float32",
                 device=device, token_budget=sum(len(t) - 1 for t in batch), dp_group=group)
    eng.add_adapter("full", LoraConfig(rank=0))
    data = [Datum(t[:-1], {"target_tokens": t[1:]}) for t in batch]

    def step() -> None:
        eng.forward_backward([ForwardBackwardRequest("full", data)])
        eng.optim_step("full", ADAM)

    return measure("twinkle full run", sum(len(d.tokens) for d in data), step, warmup, reps,
                   device)


def plain(model_dir: Path, device: str, batch: list[torch.Tensor], warmup: int,
          reps: int, group=None) -> Row:
    from transformers import AutoModelForCausalLM

    cuda = device.startswith("cuda")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    if group is not None:  # FSDP2: every decoder layer and the root sharded over the ranks
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if cuda else torch.float32,
                                  reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=ADAM.learning_rate,
                            betas=(ADAM.beta1, ADAM.beta2), eps=ADAM.eps,
                            fused=cuda and group is None)
    ids = torch.stack(batch).to(device)

    def step() -> None:
        with torch.autocast("cuda" if cuda else "cpu", dtype=torch.bfloat16,
                            enabled=cuda and group is None):
            logits = model(ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                 ids[:, 1:].flatten(), reduction="sum")
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    name = "plain FSDP2 (bf16 params, fp32 reduce, AdamW)" if group is not None else \
        "plain PyTorch (fp32 + bf16 autocast, AdamW)"
    return measure(name, ids[:, :-1].numel(), step, warmup, reps, device)


def _benches(args) -> tuple:
    """The in-process rows: the plain loop alone beside the daemon's row (--daemon)."""
    return (plain,) if args.daemon else (ours, plain)


def _rank(rank: int, args, model_dir: Path, port: int, out) -> None:
    """One GPU of an `--ranks N` run: both benches on its share of the rows."""
    import torch.distributed as dist

    cuda = args.device == "cuda"
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=args.ranks)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(rank)
    batch = [torch.randint(0, vocab, (args.seq + 1,), generator=g) for _ in range(args.batch)]
    rows = []
    for bench in _benches(args):
        rows.append(bench(model_dir, device, batch, args.warmup, args.reps, dist.group.WORLD))
        free(args.device)
    if rank == 0:  # tokens of every rank
        out[0] = [Row(r.test, r.tokens * args.ranks, r.seconds, r.peak_gib) for r in rows]
    dist.destroy_process_group()


def _spread(args, model_dir: Path) -> list[Row]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(args, model_dir, port, out), nprocs=args.ranks, join=True)
        return out[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="tiny", choices=("tiny", "qwen2.5-0.5b", "qwen3-8b"))
    ap.add_argument("--layers", type=int, default=None, help="cut the shape's depth")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4, help="rows per rank")
    ap.add_argument("--ranks", type=int, default=1, help="GPUs (processes) of the lane")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--daemon", action="store_true",
                    help="the full run through a real twinkled and the tinker client")
    ap.add_argument("--out", default=None, help="section file ('' : print only)")
    args = ap.parse_args()
    seed_all(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / args.shape
        vocab = build_model(args.shape, model_dir, torch.bfloat16, args.device, args.layers)
        params = weight_bytes(json.loads((model_dir / "config.json").read_text()), 1)
        batch = [torch.randint(0, vocab, (args.seq + 1,)) for _ in range(args.batch)]
        free(args.device)
        first, failed = [], None
        if args.daemon:  # a failure (a refusal, a load error) still leaves the plain row
            try:
                first = [daemon_row(model_dir, args.device, args.ranks, args.batch, args.seq,
                                    args.warmup, args.reps)]
            except (Exception, SystemExit) as e:
                print(f"--daemon failed: {e}", file=sys.stderr)
                failed = f"{type(e).__name__}: {e}".splitlines()[0]
        if args.ranks > 1:
            rows = first + _spread(args, model_dir)
        else:
            rows = first
            for bench in _benches(args):  # one at a time on the card: freed in between
                rows.append(bench(model_dir, args.device, batch, args.warmup, args.reps))
                free(args.device)
    card = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor()
    lines = [f"## Full-parameter run{' through the daemon' if args.daemon else ''} vs plain "
             f"PyTorch: {args.shape}"
             f"{'' if args.layers is None else f' ({args.layers} layers)'}, "
             f"{params / 1e9:.2f}B parameters, {args.ranks} x {args.batch} x {args.seq} "
             f"tokens, {args.ranks} x {card}", "",
             f"`{' '.join([Path(sys.argv[0]).name, *sys.argv[1:]])}`", "",
             "| | tok/s | MFU (6N) | peak GiB |", "|---|---|---|---|"]
    for r in rows:
        m = _mfu(r, params, args.device, args.ranks)
        lines.append(f"| {r.test} | {r.tokens / r.seconds:,.0f} | "
                     f"{'-' if m is None else f'{m:.1%}'} | "
                     f"{'-' if r.peak_gib is None else f'{r.peak_gib:.1f}'} |")
    if failed:
        lines += ["", f"Through the daemon: **failed**: {failed} (the daemon's log tail above)."]
    if args.daemon and len(rows) == 2:
        ratio = rows[0].tokens / rows[0].seconds / (rows[1].tokens / rows[1].seconds)
        lines += ["", f"Through the daemon / plain: **{ratio:.2f}x** the plain loop's tok/s. "
                  f"{layout_note(args.device, args.ranks)}"]
    emit("\n".join(lines) + "\n", section_path("full") if args.out is None else args.out)


if __name__ == "__main__":
    main()
