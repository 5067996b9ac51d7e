"""Benchmark the multi-LoRA engine against plain transformers + peft, on the same card.

Why: the engine's point is co-batching. K tenants' small steps run as one pass through the
shared base model instead of K small passes. This script measures, in one run and on the
same base weights (one random-weight checkpoint, loaded by both sides):

Training (K=8 adapters, LoRA rank 32 / alpha 32 on q,k,v,o,gate,up,down; a 1 x S batch of
random tokens per adapter; cross entropy on the next token; one AdamW step per adapter):
  (a) ours:        one `Engine.forward_backward` with K requests + one `optim_steps` for K;
  (b) peft 1-by-1: one PeftModel with K adapters; per adapter `set_adapter`, forward with
                   labels, backward, that adapter's own AdamW step;
  (c) peft packed: the same K x S tokens as one K x S batch through a single adapter, i.e.
                   what co-batching could at best reach. The target is (a) >= 0.90 x (c).
Sampling (K adapters x 8 prompts, greedy, a fixed number of new tokens):
  ours = one `Engine.sample` call with every request; peft = `generate` per adapter.

Peft runs with its defaults (adapter weights upcast to fp32, sdpa attention). Timings are
medians after warm-up rounds, with the GPU synchronised around each timed region.

    python bench/bench_engine.py --shape tiny --device cpu
    python bench/bench_engine.py --shape qwen2.5-0.5b --shape qwen3-8b

`--head full` trains through the whole-vocabulary logits (the reference path), `--head
chunked` through the chunked head (chunked_logprobs.py), `--head auto` (the default) as the
engine chooses; `--head both` times full and chunked on one engine.
`--unembed` puts the adapters on lm_head too (as Tinker's default does); `--unembed both`
times a set of adapters without and one with. `--skip-peft` times the engine alone,
`--fuse no|both` times the adapters' q/k/v and gate/up A matmuls one per module (the
reference path) instead of one per group (lora_fused.py). `--layers N` cuts the shape's
depth (a small CPU run of a real width and vocabulary).
On a GPU the rows give the MFU (4N FLOPs a trained token against the card's dense bf16
peak); on a CPU the process's peak resident memory (one run per head for a comparison).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import resource
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import shape_deepseek  # bench/ is the script's directory
import shape_gpt_oss
import shape_qwen35
import torch
from output import section_path

from twinkled.engine.engine import Engine
from twinkled.protocol.sizing import weight_bytes
from twinkled.protocol.types import (
    LINEAR_ATTN_MODULES,
    AdamParams,
    Datum,
    ForwardBackwardRequest,
    LoraConfig,
    SampleRequest,
    SamplingParams,
)

K = 8  # adapters
RANK = ALPHA = 32
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHAPES = ("tiny", "qwen2.5-0.5b", "qwen3-8b", "qwen3.5-9b", "qwen3.5-35b-a3b",
          "gpt-oss-20b", "deepseek-v3")
SAMPLING_SHAPES = ("tiny", "qwen2.5-0.5b")  # 8B sampling one adapter at a time takes too long


@dataclass(frozen=True)
class Sizes:
    seq: int  # S: tokens per adapter per training step
    rounds: int  # timed training rounds (median); 2 warm-up rounds first
    prompts: int  # prompts per adapter when sampling
    prompt_len: int
    new_tokens: int
    sample_rounds: int  # timed sampling rounds (median); 1 warm-up round first


GPU_SIZES = Sizes(seq=512, rounds=5, prompts=8, prompt_len=64, new_tokens=128, sample_rounds=3)
CPU_SIZES = Sizes(seq=128, rounds=3, prompts=8, prompt_len=32, new_tokens=32, sample_rounds=1)


@dataclass
class Row:
    test: str
    tokens: int  # tokens per unit (one training round, one sampling round)
    seconds: float  # median time per unit
    peak_gib: float | None
    mfu: float | None = None

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds


def seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def sync(device: str) -> None:
    if device.startswith("cuda"):  # "cuda" or one rank's "cuda:N"
        torch.cuda.synchronize()


def free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def measure(test: str, tokens: int, fn: Callable[[], None], warmup: int, reps: int,
            device: str) -> Row:
    """Median wall time of `fn` over `reps` runs after `warmup` runs, and peak GPU memory."""
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**30
    return Row(test, tokens, statistics.median(times), peak)


PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def mfu(row: Row, n_params: int, device: str) -> float | None:
    """Share of the card's dense bf16 peak that 4N FLOPs a trained token make."""
    if device != "cuda":
        return None
    peak = next((v for k, v in PEAK_BF16.items() if k in torch.cuda.get_device_name()), None)
    return None if peak is None else row.throughput * 4 * n_params / peak


def build_model(shape: str, out: Path, dtype: torch.dtype, device: str,
                layers: int | None = None) -> int:
    """Write a random-weight checkpoint of `shape` (plus a small tokenizer); return its vocab."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

    from twinkled.engine.tiny import build_tiny_model, build_tokenizer

    seed_all(0)
    if shape == "tiny":
        build_tiny_model(out)
        return Qwen3Config.from_pretrained(out).vocab_size
    if shape == "qwen3-8b" and layers is None:  # layer by layer: ~30 s, not minutes
        from bench_tp import write_random_checkpoint

        write_random_checkpoint(shape, out)
        return Qwen3Config.from_pretrained(out).vocab_size
    common = dict(vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6)
    if layers is not None:
        common["num_hidden_layers"] = layers
    if shape == "qwen3.5-9b":
        cfg = shape_qwen35.qwen35_9b(layers)
    elif shape == "qwen3.5-35b-a3b":
        cfg = shape_qwen35.qwen35_35b_a3b(layers or shape_qwen35.MOE_LAYERS)
    elif shape == shape_gpt_oss.NAME:
        cfg = shape_gpt_oss.config(layers)
    elif shape == "deepseek-v3":  # 3 dense + 1 MoE layer by default
        cfg = shape_deepseek.deepseek_v3(layers)
    elif shape == "qwen2.5-0.5b":
        cfg = Qwen2Config(hidden_size=896, intermediate_size=4864,
                          num_attention_heads=14, num_key_value_heads=2,
                          tie_word_embeddings=True, max_position_embeddings=32768,
                          **{"num_hidden_layers": 24, **common})
    else:
        cfg = Qwen3Config(hidden_size=4096, intermediate_size=12288,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                          tie_word_embeddings=False, max_position_embeddings=40960,
                          **{"num_hidden_layers": 36, **common})
    with torch.device(device):  # random init on the card is much faster for 8B
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.to(device)
    model.save_pretrained(str(out))
    build_tokenizer(out)  # the engine needs one; random ids stay below the model's vocab
    del model
    free(device)
    return cfg.vocab_size


def active_params(model) -> int:
    """The parameters a token runs through (N of the 4N FLOPs): an MoE model's experts
    count at top_k / experts."""
    total = sum(p.numel() for p in model.hf.parameters())
    for block in model.moe.values():
        n = block.gate_up.numel() + block.down.numel()
        total -= n - n * block.top_k // block.n_experts
    return total


def random_adapters(eng: Engine, n: int, rank: int) -> list[str]:
    """Adapters a0..a{n-1} of `rank` on attention and MLP, their B drawn (it starts at
    zero) so that each changes the model's output as a trained one would."""
    names = [f"a{i}" for i in range(n)]
    for i, name in enumerate(names):
        eng.add_adapter(name, LoraConfig(rank=rank, alpha=rank, seed=i, train_unembed=False))
        a = eng.pool.get(name)
        for key in a.bank.shapes:
            torch.nn.init.normal_(a.bank.B[key][a.slot], std=0.01)
    return names


def bench_ours(model_dir: Path, dtype: torch.dtype, device: str, sz: Sizes,
               train: list[torch.Tensor], prompts: list[list[int]] | None,
               heads: tuple[str, ...] = ("auto",), unembeds: tuple[bool, ...] = (False,),
               fuses: tuple[bool, ...] = (True,)) -> list[Row]:
    eng = Engine(model_dir, dtype=dtype, device=device, max_rank=RANK)
    n_params = weight_bytes(eng.model.config.to_dict(), 1, 1)  # bytes at 1 B each = N
    if eng.model.sinks is not None:  # gpt-oss: the parameters a token uses (top-k experts)
        n_params = shape_gpt_oss.active_params(eng.model.hf)
    elif eng.model.hybrid is not None or eng.model.moe:  # (sizing's formula: dense, full attn)
        n_params = active_params(eng.model)
    rows = []
    adam = AdamParams(learning_rate=1e-4)
    for unembed in unembeds:
        names = [f"a{i}" + ("-head" if unembed else "") for i in range(K)]
        for i, name in enumerate(names):
            eng.add_adapter(name, LoraConfig(rank=RANK, alpha=ALPHA, seed=i, train_attn=True,
                                             train_mlp=True, train_unembed=unembed))
        reqs = [ForwardBackwardRequest(name, [Datum(tokens=x[:-1], loss_inputs={
            "target_tokens": x[1:], "weights": torch.ones(sz.seq)})], loss_fn="cross_entropy")
            for name, x in zip(names, train, strict=True)]

        def train_round(reqs=reqs, names=names) -> None:
            eng.forward_backward(reqs)
            eng.optim_steps([(name, adam) for name in names])

        for head, fuse in ((h, f) for f in fuses for h in heads):
            eng.model.head, eng.model.fuse_lora = head, fuse
            label = (f"(a) ours: 8 adapters co-batched, head {head}"
                     + ("" if fuse else ", LoRA unfused")
                     + (", LoRA on lm_head" if unembed else ""))
            used = eng.model.recompute.used
            row = measure(label, K * sz.seq, train_round, 2, sz.rounds, device)
            row.mfu = mfu(row, n_params, device)
            if eng.model.recompute.used > used:
                row.test += " (recomputed activations)"
            rows.append(row)
        if prompts is None or unembed != unembeds[-1]:
            for name in names:
                eng.remove_adapter(name)
            free(device)
    if prompts is not None:
        params = SamplingParams(max_tokens=sz.new_tokens, temperature=0.0, stop=[])
        sreqs = [SampleRequest(names[j // sz.prompts], p, params, num_samples=1)
                 for j, p in enumerate(prompts)]

        def sample_round() -> None:
            out = eng.sample(sreqs)
            assert all(len(s.tokens) == sz.new_tokens for r in out for s in r.sequences)

        rows.append(measure("sampling, ours: one mixed-adapter batch",
                            len(prompts) * sz.new_tokens, sample_round, 1, sz.sample_rounds,
                            device))
    return rows  # the caller frees the engine


def bench_peft(model_dir: Path, dtype: torch.dtype, device: str, sz: Sizes,
               train: list[torch.Tensor], prompts: list[list[int]] | None,
               packed_only: bool = False) -> list[Row]:
    """peft's rows: (b) the K adapters one at a time, (c) K x S packed through one adapter.
    `packed_only` builds one adapter and times (c) alone: the bound bench_multitenant
    compares with, on models where K adapters' states beside the packed batch do not fit
    (gpt-oss-20b with every expert adapted ran out of an H200's memory so)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    def lora() -> PeftLoraConfig:
        # (linear attention's modules: Qwen3.5's, as train_attn adapts them; absent elsewhere)
        # (experts: as ours, a pair per expert, peft's target_parameters; shared experts'
        # gate/up/down_proj match TARGETS)
        return PeftLoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                              target_modules=TARGETS + list(LINEAR_ATTN_MODULES),
                              target_parameters=experts or None)

    names = [f"a{i}" for i in range(1 if packed_only else K)]
    shape_qwen35.torch_rule_for_peft()
    base = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation=shape_gpt_oss.attn_implementation(model_dir))
    experts = shape_gpt_oss.peft_kwargs(model_dir).get("target_parameters") or sorted(
        {n.split(".", 3)[-1] for n, _ in base.named_parameters() if ".mlp.experts." in n},
        reverse=True)  # (gate_up_proj, down_proj)
    seed_all(1)
    model = get_peft_model(base.to(device), lora(), adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, lora())
    model.train()
    opts = {name: torch.optim.AdamW(
        [p for n, p in model.named_parameters() if f".{name}." in n], lr=1e-4,
        betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0, fused=True if device == "cuda" else None)
        for name in names}
    inputs = [x[:-1].view(1, -1).to(device) for x in train]
    packed = torch.cat(inputs)

    def step(name: str, ids: torch.Tensor) -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)

    def one_by_one() -> None:
        for name, ids in zip(names, inputs, strict=True):
            model.set_adapter(name)
            step(name, ids)

    def packed_round() -> None:
        model.set_adapter(names[0])
        step(names[0], packed)

    rows = [] if packed_only else [measure("(b) peft: one adapter at a time", K * sz.seq,
                                           one_by_one, 2, sz.rounds, device)]
    rows += [measure("(c) peft: 8 x S packed, one adapter", K * sz.seq, packed_round, 2,
                    sz.rounds, device)]
    opts.clear()  # drop the optimizer states before sampling
    free(device)
    if prompts is not None:
        model.eval()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    torch.nn.init.normal_(p, std=0.01)
        batches = [torch.tensor(prompts[i * sz.prompts:(i + 1) * sz.prompts], device=device)
                   for i in range(K)]

        def sample_round() -> None:
            for name, ids in zip(names, batches, strict=True):
                model.set_adapter(name)
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                     max_new_tokens=sz.new_tokens, min_new_tokens=sz.new_tokens,
                                     do_sample=False, pad_token_id=0)
                assert out.shape[1] == sz.prompt_len + sz.new_tokens

        # One round is K full generate calls (~36 s for 0.5B on an H200), so: a short
        # warm-up call, then a single timed round.
        model.set_adapter(names[0])
        model.generate(input_ids=batches[0], attention_mask=torch.ones_like(batches[0]),
                       max_new_tokens=4, do_sample=False, pad_token_id=0)
        rows.append(measure("sampling, peft: generate per adapter",
                            K * sz.prompts * sz.new_tokens, sample_round, 0, 1, device))
    return rows  # the caller frees the model


def _progress(rows: list[Row]) -> None:
    for r in rows:
        print(f"-- {r.test}: {r.throughput:,.0f} tok/s, {r.seconds:.3f} s, peak "
              f"{r.peak_gib or 0:.1f} GiB", flush=True)


def run_shape(shape: str, device: str, sample: bool, peft: bool = True,
              heads: tuple[str, ...] = ("auto",), unembeds: tuple[bool, ...] = (False,),
              layers: int | None = None, fuses: tuple[bool, ...] = (True,)) -> str:
    """Benchmark one shape; return its markdown section."""
    sz = GPU_SIZES if device == "cuda" else CPU_SIZES
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if shape == "qwen3.5-35b-a3b":  # (its depth is said in the section's title)
        layers = layers or shape_qwen35.MOE_LAYERS
    with tempfile.TemporaryDirectory(prefix="bench_engine_") as tmp:
        model_dir = Path(tmp)
        vocab = build_model(shape, model_dir, dtype, device, layers)
        seed_all(2)
        train = [torch.randint(0, vocab, (sz.seq + 1,)) for _ in range(K)]
        prompts = ([torch.randint(0, vocab, (sz.prompt_len,)).tolist()
                    for _ in range(K * sz.prompts)] if sample else None)
        rows = bench_ours(model_dir, dtype, device, sz, train, prompts, heads, unembeds, fuses)
        _progress(rows)  # (as it comes: a call that runs out of time keeps these)
        free(device)
        if peft:
            theirs = bench_peft(model_dir, dtype, device, sz, train, prompts)
            _progress(theirs)
            rows += theirs
        free(device)
    rows.sort(key=lambda r: r.test.startswith("sampling"))  # training (a, b, c) first
    by = {r.test[:3]: r.throughput for r in rows}  # (a): the last head timed
    by.update({r.test[:14]: r.throughput for r in rows if r.test.startswith("sampling")})
    ratios = []
    if peft:
        ratios += [("(a) / (c): ours vs packed upper bound (target >= 0.90)", by["(a)"] / by["(c)"]),
                   ("(a) / (b): ours vs peft one at a time", by["(a)"] / by["(b)"]),
                   ("(c) / (b): packed vs one at a time", by["(c)"] / by["(b)"])]
    if sample and peft:
        ratios.append(("sampling: ours / peft", by["sampling, ours"] / by["sampling, peft"]))
    depth = "" if layers is None else f", {layers} layers"
    lines = [f"### {shape}{depth} ({device}, {str(dtype).removeprefix('torch.')}, {K} adapters, "
             f"LoRA r={RANK} alpha={ALPHA} on {','.join(t.split('_')[0] for t in TARGETS)}, "
             f"S={sz.seq}"
             + (f"; sampling {K}x{sz.prompts} prompts of {sz.prompt_len} tokens, "
                f"{sz.new_tokens} new, greedy" if sample else "") + ")", "",
             "| test | tokens/unit | time per unit (s) | throughput (tok/s) | MFU (4N) | "
             f"peak mem (GiB{'' if device == 'cuda' else ', process RSS'}) |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        mem = "-" if r.peak_gib is None else f"{r.peak_gib:.2f}"
        util = "-" if r.mfu is None else f"{r.mfu:.1%}"
        lines.append(f"| {r.test} | {r.tokens} | {r.seconds:.4f} | {r.throughput:,.0f} | "
                     f"{util} | {mem} |")
    if ratios:
        lines += ["", "| ratio (throughput) | value |", "|---|---:|"]
        lines += [f"| {name} | {value:.2f} |" for name, value in ratios]
    return "\n".join(lines) + "\n"


def header(device: str) -> str:
    import peft
    import transformers

    card = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (f"## Engine vs peft, {now}\n\n"
            f"- machine: {platform.node()} ({os.cpu_count()} CPUs); card: {card}\n"
            f"- torch {torch.__version__}, transformers {transformers.__version__}, "
            f"peft {peft.__version__}\n"
            f"- command: `python {' '.join(sys.argv)}`\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", choices=SHAPES,
                    help="model shape; repeatable (default: tiny on CPU, qwen2.5-0.5b on GPU)")
    ap.add_argument("--device", choices=("cpu", "cuda"),
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--skip-sampling", action="store_true")
    ap.add_argument("--skip-peft", action="store_true", help="time the engine alone")
    ap.add_argument("--head", choices=("auto", "chunked", "full", "both"), default="auto",
                    help="training's logprobs: chunked from the hidden states, through the "
                         "whole logits (the reference path), auto (the engine's default: "
                         "chunked where the logits are big); both: full, chunked on one engine")
    ap.add_argument("--unembed", choices=("no", "yes", "both"), default="no",
                    help="adapters on lm_head too (both: a set without, then one with)")
    ap.add_argument("--fuse", choices=("yes", "no", "both"), default="yes",
                    help="q/k/v and gate/up LoRA A matmuls one per group (lora_fused.py), "
                         "or one per module (the reference path); both: unfused, fused")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the shape's)")
    ap.add_argument("--write", default=section_path("engine"), metavar="PATH",
                    help="append the results to PATH ('' to skip)")
    args = ap.parse_args()
    shapes = args.shape or (["qwen2.5-0.5b"] if args.device == "cuda" else ["tiny"])

    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecations inside peft
    text = header(args.device)
    print(text)
    for shape in shapes:
        heads = ("full", "chunked") if args.head == "both" else (args.head,)
        unembeds = {"no": (False,), "yes": (True,), "both": (False, True)}[args.unembed]
        section = run_shape(shape, args.device,
                            not args.skip_sampling and shape in SAMPLING_SHAPES,
                            not args.skip_peft, heads, unembeds, args.layers,
                            {"yes": (True,), "no": (False,), "both": (False, True)}[args.fuse])
        print(section, flush=True)
        text += "\n" + section
    if args.write:
        path = Path(args.write)
        prefix = "" if path.exists() and path.stat().st_size else "# Benchmarks\n\n"
        with path.open("a") as f:
            f.write(prefix + text + "\n")
        print(f"appended to {path}")


if __name__ == "__main__":
    main()
