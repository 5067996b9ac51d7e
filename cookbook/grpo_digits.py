"""GRPO, the seed documents' RL loop, on a toy task the tiny model learns in a minute.

The task: answer in digits. The reward is the fraction of a completion's characters that
are digits, so it is verifiable and dense; a random tiny model starts near 0.03.

    python cookbook/grpo_digits.py                                  # in this process
    python cookbook/grpo_digits.py --base-url http://127.0.0.1:8000 --api-key tml-...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from peft import LoraConfig
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny import DATA, tiny_model  # noqa: E402

import twinkle_sdk as twinkle  # noqa: E402
from twinkle_sdk import (  # noqa: E402
    CompletionRewardMetric,
    Dataset,
    DatasetMeta,
    GRPOAdvantage,
    MultiLoraTransformersModel,
    Sampler,
    SamplingParams,
    TransformersModel,
)

logger = twinkle.get_logger()
NUM_GENERATIONS = 8
MAX_NEW_TOKENS = 8


def digit_reward(trajectories: list[dict]) -> list[float]:
    """Any callable over trajectories is a reward: here, the share of digit characters."""
    out = []
    for t in trajectories:
        text = twinkle.rl.completion(t)
        out.append(sum(c.isdigit() for c in text) / max(1, len(text)))
    return out


def main(argv: list[str] | None = None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory (default: the tiny RL model)")
    ap.add_argument("--base-url", help="a twinkled daemon (default: train in this process)")
    ap.add_argument("--api-key")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=1e-2)
    args = ap.parse_args(argv)
    model_id = args.model or tiny_model("rl")

    if args.base_url:  # the one line that changes: the engine is the daemon's
        twinkle.init_twinkle_client(args.base_url, args.api_key)
        Model = MultiLoraTransformersModel
    else:
        twinkle.initialize(mode="local")
        Model = TransformersModel

    dataset = Dataset(DatasetMeta(str(DATA / "digits.jsonl")))
    dataset.set_template("Template", model_id=model_id, max_length=64)
    dataset.map("MessagesProcessor")
    dataset.encode(add_generation_prompt=True)
    prompts = list(dataset)

    model = Model(model_id=model_id)
    # lm_head too: the quickest way for a tiny model to change what it says.
    model.add_adapter_to_model("default", LoraConfig(r=8, lora_alpha=16, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]))
    model.set_optimizer("AdamW", lr=args.lr)
    model.set_loss("GRPOLoss", epsilon=0.2)
    sampler = Sampler(model)
    advantage_fn = GRPOAdvantage()
    metrics = CompletionRewardMetric()
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=1.0)

    mean_rewards = []
    for step in tqdm(range(args.steps), disable=not sys.stderr.isatty()):
        sampler.sync_weights()  # the sampler reads the adapter's current weights
        params.seed = 1000 * step
        responses = sampler.sample(prompts * NUM_GENERATIONS, params)
        features, old_logps, lengths = [], [], []
        for response in responses:
            for seq in response.sequences:
                features.append(seq.new_input_feature)
                old_logps.append(seq.logprobs)
                lengths.append(len(seq.tokens))
        rewards = digit_reward(features)
        metrics.accumulate(completion_lengths=lengths, rewards={"digits": rewards})
        advantages = advantage_fn(rewards, num_generations=NUM_GENERATIONS).tolist()
        model.forward_backward(inputs=features, old_logps=old_logps, advantages=advantages)
        model.clip_grad_and_step()
        log = metrics.calculate()
        metrics.reset()
        mean_rewards.append(log["reward/digits"])
        if step % 5 == 0 or step == args.steps - 1:
            logger.info(f"[step {step}] {log} {model.calculate_metric(is_training=True)}")
    logger.info(f"mean reward {mean_rewards[0]:.3f} -> {mean_rewards[-1]:.3f}")
    return mean_rewards


if __name__ == "__main__":
    main()
