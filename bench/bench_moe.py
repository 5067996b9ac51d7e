"""Mixture-of-experts through the daemon: a Qwen3-30B-A3B shape (random weights), 8 tenants
x 1 x S tokens per step, on 1 GPU and on 2 GPUs with --ep 2; tokens/s and peak GPU memory,
beside plain transformers + peft (`target_parameters` on the experts) one tenant at a time.

Qwen3-30B-A3B's layer: hidden 2048, 32 query / 4 kv heads of 128, 128 experts of
intermediate 768, top-8, renormalised. `--layers` keeps the first N of its 48 layers: a
rank-r LoRA on every expert is 6.6M x r/8 parameters per layer per adapter (fp32 weights,
gradients and two moments: 18 bytes each), so 8 adapters on all 48 layers do not fit one
80 GB card beside the 61 GB of base weights.

    python bench/bench_moe.py --devices cuda:0,cuda:1 --layers 12      # the GPU bench
    python bench/bench_moe.py --devices cpu,cpu --tiny                  # a CPU smoke run
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_multitenant import make_keys, pct, run_tenants, start_daemon  # noqa: E402
from bench_workers import path_report, planner_report  # noqa: E402
from output import section_path  # noqa: E402
from peft_baseline import peft_run  # noqa: E402


def build(out: Path, layers: int, tiny: bool, dtype, device: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from twinkled.engine.tiny import build_tiny_model, build_tokenizer

    if tiny:
        build_tiny_model(out, arch="qwen3_moe")
        return Qwen3MoeConfig.from_pretrained(out).vocab_size
    cfg = Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                         moe_intermediate_size=768, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                         num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                         max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.save_pretrained(str(out))
    build_tokenizer(out)
    del model
    torch.cuda.empty_cache() if device.startswith("cuda") else None
    return cfg.vocab_size


class GpuMemory:
    """The most memory nvidia-smi saw in use on each GPU while it ran (MiB)."""

    def __init__(self):
        self.peak: dict[int, int] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self):
        while not self.stop.wait(0.5):
            out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True)
            for line in out.stdout.strip().splitlines():
                i, used = (int(x) for x in line.split(","))
                self.peak[i] = max(self.peak.get(i, 0), used)

    def done(self, gpus: list[int]) -> str:
        """The peaks of `gpus` (the group's cards; others may be busy with other work)."""
        self.stop.set()
        self.thread.join()
        return ", ".join(f"{self.peak.get(i, 0) / 1024:.1f}" for i in gpus) or "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", required=True, help="two devices: cuda:0,cuda:1 or cpu,cpu")
    ap.add_argument("--layers", type=int, default=12, help="of Qwen3-30B-A3B's 48")
    ap.add_argument("--tiny", action="store_true", help="the tiny test MoE (CPU smoke run)")
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank (Tinker's MoE max is 32)")
    ap.add_argument("--no-peft", action="store_true")
    ap.add_argument("--write", default=section_path("moe"))
    args = ap.parse_args()

    import torch

    devices = args.devices.split(",")
    gpu = devices[0].startswith("cuda")
    seq = args.seq or (512 if gpu else 32)
    steps = args.steps or (10 if gpu else 3)
    work = Path(tempfile.mkdtemp(prefix="bench_moe_"))
    model_dir = work / "model"
    vocab = build(model_dir, args.layers, args.tiny, torch.bfloat16 if gpu else torch.float32,
                  devices[0] if gpu else "cpu")
    cfg = work / "twinkled.toml"
    cfg.write_text(f"max_rank = {max(32, args.rank)}\n")

    rows = []
    for group, ep in (([devices[0]], 1), (devices, len(devices))):
        data = work / f"data{len(group)}"
        keys = make_keys(data, args.tenants)
        mem = GpuMemory() if gpu else None
        daemon, url, log = start_daemon(model_dir, data, work, group[0], "--devices",
                                        ",".join(group), "--ep", str(ep), "--config", str(cfg))
        try:
            res = run_tenants(url, keys, model_dir.name, vocab, seq, steps, [1] * args.tenants,
                              rank=args.rank)
            print(f"ep {ep}:", end=" ")
            planner_report(data)  # how many steps a round took, and the step target
            path_report(url)
        finally:
            daemon.terminate()
            daemon.wait(timeout=120)
            log.close()
        # The engine says when a GPU's grouped matmul falls back to a loop over groups.
        for line in (work / "twinkled.log").read_text(errors="replace").splitlines():
            if "fell back" in line:
                print(f"ep {ep}: {line}")
        peak = mem.done([int(d.split(":")[1]) for d in group]) if mem else "-"
        wall = max(r["t1"] for r in res) - min(r["t0"] for r in res)
        lat = [x for r in res for x in r["lat"]]
        rows.append((f"twinkled, {len(group)} rank(s), ep {ep}",
                     sum(r["tokens"] for r in res) / wall, pct(lat, 0.5), peak))
    if gpu and not args.no_peft:
        try:
            tps, peaks = peft_run(model_dir, args.tenants, seq, steps, args.rank,
                                  ["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"],
                                  ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
            peak = f"{peaks[0]:.1f}"
            rows.append(("transformers + peft, tenants one at a time, 1 GPU", tps, None, peak))
        except torch.OutOfMemoryError:
            rows.append(("transformers + peft, 1 GPU: out of memory", 0.0, None, "OOM"))
        except Exception as e:  # noqa: BLE001 - the baseline failing must not lose our rows
            rows.append((f"transformers + peft, 1 GPU: failed ({type(e).__name__}: "
                         f"{str(e)[:80]})", 0.0, None, "-"))

    shape = "tiny Qwen3-MoE" if args.tiny else f"Qwen3-30B-A3B shape, {args.layers} of 48 layers"
    text = (f"\n### MoE: {shape} ({args.devices}, LoRA r={args.rank} on attention, experts "
            f"and unembedding; {args.tenants} tenants x 1 x {seq}, {steps} timed steps)\n\n"
            "| run | tokens/s | step p50 (s) | peak memory per GPU (GiB) |\n|---|---:|---:|---|\n")
    for name, tps, p50, peak in rows:
        text += f"| {name} | {tps:,.0f} | {'-' if p50 is None else f'{p50:.3f}'} | {peak} |\n"
    print(text)
    if args.write:
        with Path(args.write).open("a") as f:
            f.write(text)
        print(f"appended to {args.write}")


if __name__ == "__main__":
    main()
