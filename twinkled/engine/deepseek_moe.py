"""DeepSeek-V3's (and Kimi-K2's) sparse MLP: grouped sigmoid routing plus shared experts.

The experts are moe.py's (transformers 5's fused layout, per-expert LoRA, expert
parallelism); what differs is the router and the shared experts:
- scores are sigmoid(x @ W^T) in fp32; the choice adds `e_score_correction_bias` (a
  load-balancing bias that picks experts but never weights them);
- grouped top-k: the experts fall in `n_group` groups, a group's score is the sum of its two
  best biased scores, only the `topk_group` best groups compete, and a token takes the
  top-k experts among them;
- the k weights are the unbiased scores, renormalised where `norm_topk_prob`, then times
  `routed_scaling_factor`;
- `shared_experts` (one dense MLP every token goes through) adds its output; it is an
  ordinary dense MLP for LoRA (model.layers.N.mlp.shared_experts.{gate,up,down}_proj),
  run by BaseModel.mlp.
The first `first_k_dense_replace` layers are dense (their `mlp` has no experts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from twinkled.protocol.types import EngineInputError

from .moe import MoeBlock

ARCHS = ("deepseek_v3", "kimi_k2")


class DeepseekMoeBlock(MoeBlock):
    def __init__(self, index: int, mlp, config, split=None):
        super().__init__(index, mlp, bool(config.norm_topk_prob), int(config.num_experts_per_tok),
                         split)
        self.gate = mlp.gate
        self.groups, self.top_groups = int(config.n_group or 1), int(config.topk_group or 1)
        self.scale = float(config.routed_scaling_factor)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        E, G = self.n_experts, self.groups
        scores = F.linear(x.float(), self.router.float()).sigmoid()  # [T, E]
        # read from the module at each use: it is a buffer, and moving the model to its
        # device (after the blocks are built) replaces buffers rather than their data
        choice = scores + self.gate.e_score_correction_bias.float()
        group_score = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        top = group_score.topk(self.top_groups, dim=-1)[1]
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, top, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // G, dim=1), float("-inf"))
        experts = choice.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, experts)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, (weights * self.scale).to(x.dtype)


def blocks(config, layers, split=None) -> dict[int, DeepseekMoeBlock]:
    """The sparse layers (from `first_k_dense_replace` on), checked against the layout."""
    E, G = int(config.n_routed_experts), int(config.n_group or 1)
    if E % G or not 1 <= int(config.topk_group or 1) <= G or E // G < 2:
        raise EngineInputError("model", f"n_group {G} / topk_group {config.topk_group} do not "
                               f"divide {E} experts into groups of 2 or more")
    out = {}
    for i, layer in enumerate(layers):
        mlp = layer.mlp
        if not hasattr(mlp, "experts"):
            continue  # one of the first_k_dense_replace dense layers
        if not hasattr(mlp.gate, "e_score_correction_bias") or not hasattr(mlp, "shared_experts"):
            raise EngineInputError("model", f"layer {i}: not DeepSeek-V3's MoE layout "
                                   "(gate.e_score_correction_bias, shared_experts)")
        out[i] = DeepseekMoeBlock(i, mlp, config, split)
    return out
