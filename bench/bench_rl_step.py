"""An RL step's training through the daemon, shared prefixes off and on (issue 32, item 4).

A real `twinkled serve` and the unmodified tinker client, one tenant, as an RL user trains:
P prompts x G rollouts (prompt + completion tokens, random ids: the sampling half is not
timed here), importance_sampling with one advantage per rollout on its completion, then
one optim_step. The same batch is trained by a daemon with `shared_prefix = 0` and one
with the default, one after the other on the same card; each times `--steps` such steps
after one warm-up step. Prints the training seconds per RL step and the ratio. On the 8B
(two daemon starts, ~40 s a step unshared) the run takes about 6-8 minutes.

    python bench/bench_rl_step.py --shape tiny                  # CPU: 8 x 8, 128 + 32
    python bench/bench_rl_step.py --shape qwen3-8b              # GPU: 32 x 16, 512 + 128
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from output import emit, section_path  # bench/ is the script's directory

HERE = Path(__file__).resolve().parent


def rl_data(tinker, vocab: int, prompts: int, rollouts: int, prompt_len: int, new: int,
            seed: int = 0) -> list:
    rng = random.Random(seed)
    data = []
    for _ in range(prompts):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        for _ in range(rollouts):
            seq = prompt + [rng.randrange(vocab) for _ in range(new)]
            n = len(seq) - 1
            adv = rng.gauss(0, 1)
            data.append(tinker.types.Datum(
                model_input=tinker.types.ModelInput.from_ints(seq[:-1]),
                loss_fn_inputs={"target_tokens": seq[1:],
                                "logprobs": [-12.0] * n,
                                "advantages": [0.0] * (prompt_len - 1) + [adv] * (n - prompt_len + 1)}))
    return data


def train_seconds(model_dir: Path, work: Path, device: str, vocab: int, shared: int | None,
                  sizes: tuple[int, int, int, int], steps: int) -> list[float]:
    """Seconds of each timed RL step (forward_backward + optim_step, as the client sees it)
    through a fresh daemon; `shared`: its shared_prefix (None: the default)."""
    import tinker
    from bench_multitenant import make_keys, start_daemon

    tag = "default" if shared is None else str(shared)
    data_dir = work / f"data-{tag}"
    config = work / f"twinkled-{tag}.toml"
    config.write_text("" if shared is None else f"shared_prefix = {shared}\n")
    key = make_keys(data_dir, 1)[0]
    daemon, url, log = start_daemon(model_dir, data_dir, work, device, "--config", str(config))
    try:
        tc = tinker.ServiceClient(base_url=url, api_key=key).create_lora_training_client(
            base_model=model_dir.name, rank=32, train_unembed=False).result(timeout=600)
        data = rl_data(tinker, vocab, *sizes)
        adam = tinker.types.AdamParams(learning_rate=1e-5)
        times = []
        for i in range(steps + 1):  # the first is a warm-up
            start = time.perf_counter()
            tc.forward_backward(data, "importance_sampling").result(timeout=1800)
            tc.optim_step(adam).result(timeout=600)
            if i:
                times.append(time.perf_counter() - start)
        return times
    finally:
        daemon.terminate()
        daemon.wait(timeout=120)
        log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="tiny", choices=("tiny", "qwen2.5-0.5b", "qwen3-8b"))
    ap.add_argument("--prompts", type=int)
    ap.add_argument("--rollouts", type=int)
    ap.add_argument("--prompt-len", type=int)
    ap.add_argument("--new", type=int, help="completion tokens")
    ap.add_argument("--steps", type=int, help="timed RL steps per daemon (GPU 1, CPU 2)")
    ap.add_argument("--write", default=None, help="the section's file ('' : print only)")
    args = ap.parse_args()

    import torch

    sys.path.insert(0, str(HERE))
    from bench_engine import build_model, header

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    default = (32, 16, 512, 128) if device == "cuda" else (8, 8, 128, 32)
    args.steps = args.steps or (1 if device == "cuda" else 2)  # 8B: ~40 s a step unshared
    sizes = tuple(v if v is not None else d for v, d in zip(
        (args.prompts, args.rollouts, args.prompt_len, args.new), default, strict=True))
    work = Path(tempfile.mkdtemp(prefix="bench_rl_"))
    model_dir = work / "model"
    vocab = build_model(args.shape, model_dir, dtype, device)
    runs = [(label, train_seconds(model_dir, work, device, vocab, shared, sizes, args.steps))
            for label, shared in (("shared_prefix = 0 (off)", 0), ("default (on)", None))]
    P, G, prompt_len, new = sizes
    tokens = P * G * (prompt_len + new - 1)
    text = header(device).replace("Engine vs peft", "An RL step's training through the daemon")
    text += (f"\n### {args.shape} ({device}, {str(dtype).split('.')[-1]}, one tinker tenant, "
             f"LoRA r=32, importance_sampling; {P} prompts x {G} rollouts, {prompt_len} + {new} "
             f"tokens, {tokens} row tokens a step; median of {args.steps} steps)\n\n"
             "| daemon | training s / RL step | row tok/s | speed-up |\n|---|---:|---:|---:|\n")
    base = statistics.median(runs[0][1])
    for label, times in runs:
        t = statistics.median(times)
        text += f"| {label} | {t:.2f} | {tokens / t:,.0f} | {base / t:.2f}x |\n"
    emit(text, section_path("rl_step") if args.write is None else args.write)


if __name__ == "__main__":
    main()
