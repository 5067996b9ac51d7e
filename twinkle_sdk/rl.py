"""RL pieces of the seed GRPO loop: advantages, rewards, and a reward metric."""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch


def _groups(rewards: Sequence[float], num_generations: int) -> torch.Tensor:
    """[groups, generations]. Samples come as `prompts * num_generations` (the seed loop's
    layout), so sample i belongs to prompt i % (len / num_generations)."""
    r = torch.as_tensor(list(rewards), dtype=torch.float32)
    if num_generations < 1 or r.numel() % num_generations:
        raise ValueError(f"{r.numel()} rewards do not split into groups of {num_generations}")
    return r.view(num_generations, -1).T


def _ungroup(g: torch.Tensor) -> torch.Tensor:
    return g.T.reshape(-1)


class GRPOAdvantage:
    """Reward minus its group's mean, over the group's std (`scale="group"`), the batch's
    std (`"batch"`), or not scaled (`"none"`)."""

    def __call__(self, rewards: Sequence[float], num_generations: int,
                 scale: str = "group", eps: float = 1e-4) -> torch.Tensor:
        g = _groups(rewards, num_generations)
        centred = g - g.mean(dim=1, keepdim=True)
        if scale == "group":
            centred = centred / (g.std(dim=1, keepdim=True, unbiased=False) + eps)
        elif scale == "batch":
            centred = centred / (g.std(unbiased=False) + eps)
        elif scale != "none":
            raise ValueError(f"scale must be 'group', 'batch' or 'none', not {scale!r}")
        return _ungroup(centred)


class RLOOAdvantage:
    """Reward minus the mean of the other samples of its group (leave one out)."""

    def __call__(self, rewards: Sequence[float], num_generations: int, **_ignored) -> torch.Tensor:
        if num_generations < 2:
            raise ValueError("RLOO needs at least 2 generations per prompt")
        g = _groups(rewards, num_generations)
        others = (g.sum(dim=1, keepdim=True) - g) / (num_generations - 1)
        return _ungroup(g - others)


def completion(trajectory: dict) -> str:
    """The text of a trajectory's last assistant message."""
    for m in reversed(trajectory.get("messages", [])):
        if m.get("role") == "assistant":
            return m.get("content", "")
    return ""


_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def _number(text: str) -> str | None:
    m = _ANSWER.search(text)
    return m.group(1).replace(",", "").rstrip(".") if m else None


class GSM8KAccuracyReward:
    """1.0 when the number after '####' equals the row's `ground_truth`."""

    def __call__(self, trajectories: list[dict]) -> list[float]:
        out = []
        for t in trajectories:
            got, want = _number(completion(t)), str(t.get("ground_truth", "")).replace(",", "")
            out.append(1.0 if got is not None and want and float(got) == float(want) else 0.0)
        return out


class GSM8KFormatReward:
    """1.0 when the completion ends its reasoning with '#### <number>'."""

    def __call__(self, trajectories: list[dict]) -> list[float]:
        return [1.0 if _number(completion(t)) is not None else 0.0 for t in trajectories]


class CompletionRewardMetric:
    """Mean rewards (by name) and completion length over what was accumulated."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.lengths: list[int] = []
        self.rewards: dict[str, list[float]] = {}

    def accumulate(self, completion_lengths: Sequence[int],
                   rewards: dict[str, Sequence[float]]) -> None:
        self.lengths.extend(int(n) for n in completion_lengths)
        for name, values in rewards.items():
            self.rewards.setdefault(name, []).extend(float(v) for v in values)

    def calculate(self) -> dict[str, float]:
        out = {f"reward/{k}": sum(v) / len(v) for k, v in self.rewards.items() if v}
        if self.lengths:
            out["completion_length"] = sum(self.lengths) / len(self.lengths)
        return out
