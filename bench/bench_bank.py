"""What growing a bank of adapters costs: the pause a create that needs more slots puts
into its step (a barrier step every tenant of the lane waits for).

A bank of rank-32 adapters of a model's attention and MLP modules grows slot by slot to
`--slots`; each growth is timed (device synchronised) with the card's peak memory over the
grown bank. Two ways, in the same run: on the card, a kind of state at a time (what a bank
does when its card has room for one kind of its old rows beside the grown bank), and
through host memory (what it does when the card has not: the only way before).

    python bench/bench_bank.py [--shape qwen3-8b] [--slots 20]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from output import emit, section_path  # noqa: E402

# (hidden, intermediate, layers, q out, kv out)
SHAPES = {"qwen3-8b": (4096, 12288, 36, 4096, 1024), "qwen2.5-0.5b": (896, 4864, 24, 896, 128),
          "tiny": (64, 128, 2, 64, 32)}


def targets(shape: str) -> dict[str, tuple[int, int]]:
    h, inter, layers, q, kv = SHAPES[shape]
    per_layer = {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv),
                 "self_attn.v_proj": (h, kv), "self_attn.o_proj": (q, h),
                 "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter),
                 "mlp.down_proj": (inter, h)}
    return {f"layers.{i}.{k}": v for i in range(layers) for k, v in per_layer.items()}


def grow(shape: str, slots: int, device: str, through_host: bool) -> list[tuple]:
    """(from, to, ms, peak GiB, bank GiB) for each growth up to `slots` adapters."""
    from twinkled.engine.lora import Bank

    cuda = device.startswith("cuda")
    bank = Bank(32, targets(shape), device, torch.bfloat16)
    if through_host:
        bank.parks = lambda old, capacity, big=bank.big: big(old)  # the host path if big
    rows = []
    for _ in range(slots):
        before = bank.capacity
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        bank.allocate()
        if cuda:
            torch.cuda.synchronize()
        ms = 1e3 * (time.perf_counter() - t)
        if bank.capacity != before:
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
            size = bank.capacity * bank.slot_numel * (4 * 4 + 2) / 2**30
            rows.append((before, bank.capacity, ms, peak, size))
    del bank
    if cuda:
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--slots", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--write", default=section_path("bank"))
    args = ap.parse_args()

    card = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    text = (f"## Bank growth, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n"
            f"- card: {card}; torch {torch.__version__}\n"
            f"- command: `python {' '.join(sys.argv)}`\n\n"
            f"### {args.shape}, LoRA r=32 on attention and MLP, up to {args.slots} adapters\n\n"
            "| growth (slots) | on the card (ms) | peak GiB | through host (ms) | peak GiB "
            "| host / card | bank GiB |\n|---|---:|---:|---:|---:|---:|---:|\n")
    card_rows = grow(args.shape, args.slots, args.device, through_host=False)
    host_rows = grow(args.shape, args.slots, args.device, through_host=True)
    for c, h in zip(card_rows, host_rows, strict=True):
        text += (f"| {c[0]} -> {c[1]} | {c[2]:,.1f} | {c[3]:.2f} | {h[2]:,.1f} | {h[3]:.2f} "
                 f"| {h[2] / c[2]:.1f}x | {c[4]:.2f} |\n")
    emit(text, args.write)


if __name__ == "__main__":
    main()
