"""Which kind of sparse layer each architecture has, and building them: the common kind
(moe.py: Qwen3-MoE, Mixtral, Qwen3.5-MoE, Qwen3-Next) and its relatives with their own
routing or expert maths, built on it (gpt_oss_moe.py: biases, clamped SwiGLU; deepseek_moe.py:
grouped sigmoid routing, shared experts). Apart from moe.py so that moe.py never imports
the modules that build on it."""

from __future__ import annotations

from . import deepseek_moe, gpt_oss_moe, moe
from .moe_parallel import ExpertSplit

DEEPSEEK = ("deepseek_v3", "kimi_k2")


def sparse_blocks(model_type: str, config, layers, split: ExpertSplit | None = None
                  ) -> dict[int, moe.MoeBlock]:
    """The model's sparse layers by index ({} for a dense model), as moe.moe_blocks
    describes them, built by the module that knows the architecture's experts."""
    if model_type == "gpt_oss":
        return gpt_oss_moe.gpt_oss_blocks(config, layers, split)
    if model_type in DEEPSEEK:
        return deepseek_moe.blocks(config, layers, split)
    return moe.moe_blocks(model_type, config, layers, split)
