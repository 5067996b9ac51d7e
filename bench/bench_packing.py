"""Rows of real lengths: packed micro-batches vs padded ones vs peft, on the same card.

Why: tenants send rows of mixed lengths. Padded to the longest row, a micro-batch costs
rows x longest; packed end to end (twinkled/engine/packed.py) it costs its tokens. In one
run, with the same base weights and 8 adapters (LoRA r=32 on q,k,v,o,gate,up,down):

  uniform:          8 adapters x 1 row of 512 tokens (the figure the engine is tuned on);
  mixed, padded:    8 adapters x 4 rows, lengths log-normal (median ~300, fixed seed),
                    the engine with packing off;
  mixed, packed:    the same rows, packing on (the default);
  mixed, peft:      the same rows, peft one adapter at a time, its 4 rows right-padded.

Throughput counts real tokens only. Each row is a forward/backward plus an AdamW step per
adapter. Prints a table and writes it to bench/results/packing-<time>.md (ignored).

    python bench/bench_packing.py --shape tiny --device cpu
    python bench/bench_packing.py --shape qwen2.5-0.5b --shape qwen3-8b
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from output import section_path  # bench/ is the script's directory

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import (  # noqa: E402
    ALPHA,
    RANK,
    SHAPES,
    TARGETS,
    Row,
    build_model,
    free,
    header,
    measure,
    seed_all,
)

from twinkled.engine import step  # noqa: E402
from twinkled.engine.engine import Engine  # noqa: E402
from twinkled.protocol.types import AdamParams, Datum, ForwardBackwardRequest, LoraConfig  # noqa: E402

K, ROWS = 8, 4  # adapters, rows each (mixed)
PACK_ABOVE = step.PACK_ABOVE


def mixed_lengths(n: int, cap: int, seed: int = 0) -> list[int]:
    """Log-normal lengths (median 300, sigma 0.6), as chat and RL rows come."""
    gen = torch.Generator().manual_seed(seed)
    draws = torch.randn(n, generator=gen) * 0.6 + math.log(300)
    return [int(min(cap, max(16, round(math.exp(x))))) for x in draws.tolist()]


TOKEN_BUDGET = 16384  # tokens per micro-batch (--token-budget: 4096 fits the 8B shape)


def ours(model_dir: Path, dtype, device: str, batches: list[list[torch.Tensor]], packed: bool,
         label: str, rounds: int, force: bool = False) -> Row:
    # `force`: pack even rows of one length (the engine leaves those padded) to see what the
    # packed path itself costs.
    step.PACK_ABOVE = -1.0 if force else PACK_ABOVE
    eng = Engine(model_dir, dtype=dtype, device=device, max_rank=RANK, packed=packed,
                 token_budget=TOKEN_BUDGET)
    names = [f"a{i}" for i in range(K)]
    for i, name in enumerate(names):
        eng.add_adapter(name, LoraConfig(rank=RANK, alpha=ALPHA, seed=i, train_unembed=False))
    reqs = [ForwardBackwardRequest(name, [Datum(x[:-1], {"target_tokens": x[1:]}) for x in rows])
            for name, rows in zip(names, batches, strict=True)]
    adam = AdamParams(learning_rate=1e-4)

    def round_() -> None:
        eng.forward_backward(reqs)
        eng.optim_steps([(n, adam) for n in names])

    tokens = sum(len(x) - 1 for rows in batches for x in rows)
    return measure(label, tokens, round_, 2, rounds, device)  # freed by the caller


def peft_padded(model_dir: Path, dtype, device: str, batches: list[list[torch.Tensor]],
                rounds: int) -> Row:
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    names = [f"a{i}" for i in range(K)]
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    lora = lambda: PeftLoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS,  # noqa: E731
                                  lora_dropout=0.0)
    model = get_peft_model(base.to(device), lora(), adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, lora())
    model.train()
    opts = {n: torch.optim.AdamW([p for k, p in model.named_parameters() if f".{n}." in k],
                                 lr=1e-4) for n in names}
    inputs = []
    for rows in batches:  # right-padded, padding masked out of attention and the loss
        longest = max(len(x) for x in rows)
        ids = torch.zeros((len(rows), longest), dtype=torch.long)
        mask = torch.zeros_like(ids)
        labels = torch.full_like(ids, -100)
        for i, x in enumerate(rows):
            ids[i, :len(x)], mask[i, :len(x)], labels[i, :len(x)] = x, 1, x
        inputs.append((ids.to(device), mask.to(device), labels.to(device)))

    def round_() -> None:
        for name, (ids, mask, labels) in zip(names, inputs, strict=True):
            model.set_adapter(name)
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)

    tokens = sum(len(x) - 1 for rows in batches for x in rows)
    return measure("mixed, peft: one adapter at a time, padded", tokens, round_, 2, rounds,
                   device)  # freed by the caller


def run_shape(shape: str, device: str) -> str:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    seq, rounds, cap = (512, 5, 1536) if device == "cuda" else (64, 3, 160)
    with tempfile.TemporaryDirectory(prefix="bench_packing_") as tmp:
        model_dir = Path(tmp)
        vocab = build_model(shape, model_dir, dtype, device)
        seed_all(2)
        scale = 1.0 if device == "cuda" else seq / 512
        lengths = [max(8, int(n * scale)) for n in mixed_lengths(K * ROWS, cap)]
        uniform = [[torch.randint(0, vocab, (seq + 1,))] for _ in range(K)]
        mixed = [[torch.randint(0, vocab, (n + 1,)) for n in lengths[i * ROWS:(i + 1) * ROWS]]
                 for i in range(K)]
        runs = [lambda: ours(model_dir, dtype, device, uniform, True,
                             f"uniform {K}x1x{seq}, packed", rounds),
                lambda: ours(model_dir, dtype, device, uniform, False,
                             f"uniform {K}x1x{seq}, padded", rounds),
                lambda: ours(model_dir, dtype, device, uniform, True,
                             f"uniform {K}x1x{seq}, packed (forced)", rounds, force=True),
                lambda: ours(model_dir, dtype, device, mixed, False, "mixed, padded", rounds),
                lambda: ours(model_dir, dtype, device, mixed, True, "mixed, packed", rounds),
                lambda: peft_padded(model_dir, dtype, device, mixed, rounds)]
        rows = []
        for run in runs:  # one model on the card at a time
            rows.append(run())
            free(device)
    u = rows[0].throughput
    by = {r.test: r.throughput for r in rows}
    mixed_packed, mixed_padded = by["mixed, packed"], by["mixed, padded"]
    ratios = [("mixed packed / uniform (target >= 1.0)", mixed_packed / u),
              ("mixed padded / uniform", mixed_padded / u),
              ("mixed packed / mixed padded", mixed_packed / mixed_padded),
              ("mixed packed / peft padded", mixed_packed / rows[-1].throughput),
              ("uniform: packed (forced) / padded", rows[2].throughput / rows[1].throughput)]
    lines = [f"### {shape} ({device}, {str(dtype).removeprefix('torch.')}, {K} adapters, "
             f"token_budget {TOKEN_BUDGET}; "
             f"mixed: {K}x{ROWS} rows, lengths {min(lengths)}..{max(lengths)}, "
             f"median {sorted(lengths)[len(lengths) // 2]}, {sum(lengths)} tokens)", "",
             "| test | real tokens/round | time per round (s) | real tok/s | peak mem (GiB) |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        mem = "-" if r.peak_gib is None else f"{r.peak_gib:.2f}"
        lines.append(f"| {r.test} | {r.tokens} | {r.seconds:.4f} | {r.throughput:,.0f} | {mem} |")
    lines += ["", "| ratio (real tok/s) | value |", "|---|---:|"]
    lines += [f"| {name} | {value:.2f} |" for name, value in ratios]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", choices=SHAPES)
    ap.add_argument("--device", choices=("cpu", "cuda"),
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--token-budget", type=int, default=TOKEN_BUDGET)
    args = ap.parse_args()
    globals()["TOKEN_BUDGET"] = args.token_budget
    shapes = args.shape or (["qwen2.5-0.5b"] if args.device == "cuda" else ["tiny"])
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    text = header(args.device).replace("Engine vs peft", "Packing: rows of real lengths")
    print(text, flush=True)
    for shape in shapes:
        section = run_shape(shape, args.device)
        print(section, flush=True)
        text += "\n" + section
    path = Path(section_path("packing"))
    path.write_text(text)
    print(f"written to {path}")


if __name__ == "__main__":
    main()
