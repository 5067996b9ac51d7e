"""A full-parameter run (rank 0, twinkled/engine/full_param.py) against a plain PyTorch loop,
on the same card and the same random-weight checkpoint.

  ours:  Engine(dtype=bfloat16): bf16 weights for the passes, fp32 masters and AdamW
         moments, one `forward_backward` of B x S tokens + one `optim_step`;
  plain: the Hugging Face model in fp32 under bf16 autocast, summed token cross-entropy,
         torch.optim.AdamW (fused on CUDA): the usual mixed-precision loop.

Rows: tokens/s (median of timed rounds after warm-up), MFU (6N FLOPs a trained token
against the card's dense bf16 peak) and peak GPU memory. One GPU: the engine does not
shard a full run over a lane's GPUs (no FSDP2 yet), so the 8B shape does not fit a card
(~16 bytes a parameter); `--layers N` cuts a shape's depth to one that does.

    python bench/bench_full.py --shape tiny --device cpu
    python bench/bench_full.py --shape qwen3-8b --layers 12 --seq 2048 --batch 2
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
from output import emit, section_path

from twinkled.engine.engine import Engine
from twinkled.protocol.sizing import weight_bytes
from twinkled.protocol.types import AdamParams, Datum, ForwardBackwardRequest, LoraConfig

ADAM = AdamParams(learning_rate=1e-5, beta1=0.9, beta2=0.95, eps=1e-8)


def _mfu(row: Row, params: int, device: str) -> float | None:
    if device != "cuda":
        return None
    peak = next((v for k, v in PEAK_BF16.items() if k in torch.cuda.get_device_name()), None)
    return None if peak is None else row.tokens / row.seconds * 6 * params / peak


def ours(model_dir: Path, device: str, batch: list[torch.Tensor], warmup: int,
         reps: int) -> Row:
    eng = Engine(model_dir, dtype="bfloat16" if device == "cuda" else "float32",
                 device=device, token_budget=sum(len(t) - 1 for t in batch))
    eng.add_adapter("full", LoraConfig(rank=0))
    data = [Datum(t[:-1], {"target_tokens": t[1:]}) for t in batch]

    def step() -> None:
        eng.forward_backward([ForwardBackwardRequest("full", data)])
        eng.optim_step("full", ADAM)

    return measure("twinkle full run", sum(len(d.tokens) for d in data), step, warmup, reps,
                   device)


def plain(model_dir: Path, device: str, batch: list[torch.Tensor], warmup: int,
          reps: int) -> Row:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=ADAM.learning_rate,
                            betas=(ADAM.beta1, ADAM.beta2), eps=ADAM.eps,
                            fused=device == "cuda")
    ids = torch.stack(batch).to(device)

    def step() -> None:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                 ids[:, 1:].flatten(), reduction="sum")
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return measure("plain PyTorch (fp32 + bf16 autocast, AdamW)", ids[:, :-1].numel(), step,
                   warmup, reps, device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="tiny", choices=("tiny", "qwen2.5-0.5b", "qwen3-8b"))
    ap.add_argument("--layers", type=int, default=None, help="cut the shape's depth")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None, help="section file ('' : print only)")
    args = ap.parse_args()
    seed_all(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / args.shape
        vocab = build_model(args.shape, model_dir, torch.bfloat16, args.device, args.layers)
        params = weight_bytes(json.loads((model_dir / "config.json").read_text()), 1)
        batch = [torch.randint(0, vocab, (args.seq + 1,)) for _ in range(args.batch)]
        rows = []
        for bench in (ours, plain):  # one at a time on the card: freed in between
            rows.append(bench(model_dir, args.device, batch, args.warmup, args.reps))
            free(args.device)
    card = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor()
    lines = [f"## Full-parameter run vs plain PyTorch: {args.shape}"
             f"{'' if args.layers is None else f' ({args.layers} layers)'}, "
             f"{params / 1e9:.2f}B parameters, {args.batch} x {args.seq} tokens, {card}", "",
             f"`{' '.join([Path(sys.argv[0]).name, *sys.argv[1:]])}`", "",
             "| | tok/s | MFU (6N) | peak GiB |", "|---|---|---|---|"]
    for r in rows:
        m = _mfu(r, params, args.device)
        lines.append(f"| {r.test} | {r.tokens / r.seconds:,.0f} | "
                     f"{'-' if m is None else f'{m:.1%}'} | "
                     f"{'-' if r.peak_gib is None else f'{r.peak_gib:.1f}'} |")
    emit("\n".join(lines) + "\n", section_path("full") if args.out is None else args.out)


if __name__ == "__main__":
    main()
