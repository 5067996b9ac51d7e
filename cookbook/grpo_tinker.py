"""GRPO on the digits toy task with the unmodified tinker client against a daemon:
twinkle_sdk gives the data, rewards and advantages; tinker samples and trains.

    python cookbook/grpo_tinker.py --base-url http://127.0.0.1:8000 --api-key tml-... --model <dir>
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tinker import types
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_digits import MAX_NEW_TOKENS, NUM_GENERATIONS, digit_reward  # noqa: E402
from tiny import DATA, tiny_model  # noqa: E402

from twinkle_sdk import Dataset, DatasetMeta, GRPOAdvantage, init_tinker_compat_client  # noqa: E402
from twinkle_sdk.client import served_name  # noqa: E402


def main(argv: list[str] | None = None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--api-key", required=True)
    ap.add_argument("--model", help="the daemon's model directory (default: tiny RL model)")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args(argv)
    model_id = args.model or tiny_model("rl")

    dataset = Dataset(DatasetMeta(str(DATA / "digits.jsonl")))
    dataset.set_template("Template", model_id=model_id, max_length=64)
    dataset.map("MessagesProcessor")
    dataset.encode(add_generation_prompt=True)
    prompts = [list(row["input_ids"]) for row in dataset]

    service_client = init_tinker_compat_client(args.base_url, args.api_key)
    # Seeded, as its sampling is: a run is reproducible (the daemon draws a seed otherwise).
    training_client = service_client.create_lora_training_client(
        base_model=served_name(model_id), rank=8, seed=0).result()
    advantage_fn = GRPOAdvantage()
    mean_rewards = []
    for step in tqdm(range(args.steps), disable=not sys.stderr.isatty()):
        sampler = training_client.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=1.0, seed=step)
        futures = [sampler.sample(types.ModelInput.from_ints(p), NUM_GENERATIONS, params)
                   for p in prompts]
        # Prompt-major here (one call per prompt); the advantage wants generation-major.
        seqs = [(p, s) for p, f in zip(prompts, futures, strict=True)
                for s in f.result().sequences]
        order = [i * NUM_GENERATIONS + g for g in range(NUM_GENERATIONS)
                 for i in range(len(prompts))]
        seqs = [seqs[k] for k in order]
        texts = [{"messages": [{"role": "assistant", "content":
                                training_client.get_tokenizer().decode(s.tokens)}]}
                 for _, s in seqs]
        rewards = digit_reward(texts)
        advantages = advantage_fn(rewards, num_generations=NUM_GENERATIONS).tolist()
        data = []
        for (prompt, s), adv in zip(seqs, advantages, strict=True):
            tokens = prompt + list(s.tokens)
            n, pad = len(s.tokens), len(prompt) - 1
            data.append(types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:],
                                "logprobs": [0.0] * pad + list(s.logprobs),
                                "advantages": [0.0] * pad + [adv / n / len(seqs)] * n}))
        training_client.forward_backward(data, "importance_sampling").result()
        training_client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        mean_rewards.append(sum(rewards) / len(rewards))
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step}: mean reward {mean_rewards[-1]:.3f}")
    return mean_rewards


if __name__ == "__main__":
    main()
