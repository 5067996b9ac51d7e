"""tinker-cookbook 0.6.1's RL loop (`tinker_cookbook.rl.train.main`), unmodified, with its
stable_reinforce loss, against a real `twinkled serve` on a tiny model: offline, on a toy
task, and the reward rises.

The cookbook is installed without its dependencies (its pins include a torch the project
does not use); `scripts/install.sh` adds the few it imports. Offline, the tokenizer comes
from the cookbook's own registry (`register_tokenizer`) under the name the daemon serves.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest

cookbook = pytest.importorskip("tinker_cookbook")
tinker = pytest.importorskip("tinker")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import chz  # noqa: E402  (after the skips: only there when the cookbook is)
from tinker_cookbook import tokenizer_utils  # noqa: E402
from tinker_cookbook.rl.types import (  # noqa: E402
    Env,
    EnvGroupBuilder,
    RLDataset,
    RLDatasetBuilder,
    StepResult,
)

PROMPT = [5, 17, 99, 3]  # any tokens: the toy env ignores what they say
STEPS = 14


class EvenTokens(Env):
    """One turn; the reward is the share of sampled tokens whose id is even, a skill the
    policy can learn from nothing but the reward."""

    async def initial_observation(self):
        return tinker.ModelInput.from_ints(PROMPT), []

    async def step(self, action, *, extra=None):
        reward = sum(t % 2 == 0 for t in action) / max(len(action), 1)
        return StepResult(reward=reward, episode_done=True,
                          next_observation=tinker.ModelInput.empty(), next_stop_condition=[])


class Group(EnvGroupBuilder):
    async def make_envs(self):
        return [EvenTokens() for _ in range(8)]


class Batches(RLDataset):
    def get_batch(self, index):
        return [Group() for _ in range(4)]

    def __len__(self):
        return STEPS


@chz.chz
class Toy(RLDatasetBuilder):
    async def __call__(self):
        return Batches(), None


@pytest.fixture(scope="module")
def flat_daemon(tmp_path_factory):
    """A daemon on a tiny model with small embeddings: its next-token distributions are
    broad, so sampling at T=1 (the cookbook's default) explores."""
    from daemon import Daemon, make_key
    from transformers import AutoTokenizer

    from twinkled.engine.tiny import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("flat") / "tiny-flat", embed_std=0.02)
    data = tmp_path_factory.mktemp("flat-data")
    d = Daemon(model, data, data / "twinkled.log")
    d.key = make_key(data, "alice")
    tokenizer_utils.register_tokenizer(model.name, lambda: AutoTokenizer.from_pretrained(model))
    d.model_name = model.name
    yield d
    d.stop()


def test_cookbook_rl_loop_with_stable_reinforce_raises_the_reward(flat_daemon, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setenv("TINKER_API_KEY", flat_daemon.key)
    assert_toy_reward_rises(flat_daemon.url, flat_daemon.model_name, tmp_path / "run")


def assert_toy_reward_rises(url: str, model_name: str, log_path) -> None:
    """The cookbook's RL loop on the toy task against the daemon at `url` (the key in
    TINKER_API_KEY): the reward rises over its STEPS steps."""
    # The loop's module here, not at the top: it takes ~0.8 CPU-s to import, in every test
    # process that collects this file.
    from tinker_cookbook.rl import train

    config = train.Config(
        learning_rate=3e-2, dataset_builder=Toy(), model_name=model_name,
        recipe_name="twinkle_toy", max_tokens=8, log_path=str(log_path),
        base_url=url, loss_fn="stable_reinforce", lora_rank=8,
        eval_every=0, save_every=0, num_groups_to_log=0, rollout_json_export=False)
    asyncio.run(train.main(config))

    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").open()]
    rewards = [r["env/all/reward/total"] for r in rows if "env/all/reward/total" in r]
    assert len(rewards) == STEPS
    first = sum(rewards[:3]) / 3
    # The best three steps in a row after the first three: the loop seeds neither its adapter
    # nor its samples, so runs differ: seen from 0.5 to 1.0, in a slow one to 0.84, and once
    # to 0.98 by step 6 and back to 0.70 over the last three (lr 3e-2 on a toy). Chance
    # stays at 0.5 (+- ~0.03 a step: 32 samples of 8 tokens), however the loop is broken.
    late = max(sum(rewards[i:i + 3]) / 3 for i in range(3, STEPS - 2))
    assert first < 0.7 and late > 0.75 and late > first + 0.2, rewards
