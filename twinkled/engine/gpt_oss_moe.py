"""gpt-oss's sparse MLP as a MoeBlock (moe.py): the same grouped expert matmuls and
per-expert multi-LoRA, with gpt-oss's router, biases and activation.

transformers' layout: `mlp.router` (weight [E, H], bias [E]); `mlp.experts.gate_up_proj`
[E, H, 2I] with gate and up INTERLEAVED along the last dim (gate = [..., ::2],
up = [..., 1::2]), `gate_up_proj_bias` [E, 2I], `down_proj` [E, I, H], `down_proj_bias`
[E, H]: stored transposed against Qwen3-MoE's. Our block holds the two weights as transposed
views in moe.py's [E, out, in], so the grouped matmuls and the LoRA pairs are moe.py's; the output order of gate_up stays interleaved, so an adapter's
B rows index the same outputs as transformers'.

Expert parallelism (moe_parallel.py) as for the common block: a rank keeps its experts'
weights and biases (`expert_parameters`) and computes only their (token, expert) pairs; each
pair carries its own expert's biases, so the ranks' partial sums add up to the whole.

Routing: top-k of the router logits (bias included), softmax over those k.
Activation (clamped SwiGLU): gate clamped above at `limit`, up to [-limit, limit],
out = (up + 1) * gate * sigmoid(alpha * gate).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from twinkled.protocol.types import EngineInputError

from .moe import MoeBlock
from .moe_parallel import ExpertSplit


class GptOssMoeBlock(MoeBlock):
    def __init__(self, index: int, mlp, config, split: ExpertSplit | None = None):
        experts = mlp.experts
        self.index = index
        self.router, self.router_bias = mlp.router.weight, mlp.router.bias
        self.experts = experts
        self.gate_up_bias, self.down_bias = experts.gate_up_proj_bias, experts.down_proj_bias
        # transformers' own module's constants (older releases hard-code alpha, newer read
        # the config's swiglu_alpha): what its forward computes is the reference
        self.alpha, self.limit = float(experts.alpha), float(experts.limit)
        self.n_experts = self.router.shape[0]
        self.split = split  # expert parallelism: this rank computes the pairs of `owned`
        self.owned = (slice(0, self.n_experts) if split is None
                      else split.owned(self.n_experts, index))
        self.top_k = int(config.num_experts_per_tok)
        self.normalize = False
        prefix = f"model.layers.{index}.mlp.experts."
        self.keys = {p: prefix + p for p in ("gate_up_proj", "down_proj")}

    # moe.py's [E, out, in] as views of transformers' [E, in, out] (its module stays
    # runnable): the grouped matmul then reads the weights as stored, row-major [in, out].
    # Taken at each use, not kept: the blocks are built before the model moves to its device,
    # and a view kept from then would still read the host copy.
    @property
    def gate_up(self) -> torch.Tensor:
        return self.experts.gate_up_proj.transpose(1, 2)

    @property
    def down(self) -> torch.Tensor:
        return self.experts.down_proj.transpose(1, 2)

    def expert_parameters(self) -> list[torch.nn.Parameter]:
        """The experts' weights and their biases, experts first (transformers' own)."""
        e = self.experts
        return [e.gate_up_proj, e.down_proj, e.gate_up_proj_bias, e.down_proj_bias]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.router, self.router_bias)
        top, experts = torch.topk(logits, self.top_k, dim=-1)
        return experts, torch.softmax(top, dim=-1).to(x.dtype)

    def glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gpt-oss's clamped SwiGLU over gate and up interleaved (MoeBlock.expert_pairs adds
        the biases)."""
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)


def gpt_oss_blocks(config, layers, split: ExpertSplit | None = None
                   ) -> dict[int, GptOssMoeBlock]:
    """Every layer's sparse MLP; with `split`, each block computes its rank's experts."""
    blocks = {}
    for i, layer in enumerate(layers):
        found = sorted(n for n, _ in layer.mlp.named_parameters())
        if found != ["experts.down_proj", "experts.down_proj_bias", "experts.gate_up_proj",
                     "experts.gate_up_proj_bias", "router.bias", "router.weight"]:
            raise EngineInputError("model", f"layer {i}: gpt-oss MoE layout {found} is not "
                                   "supported")
        blocks[i] = GptOssMoeBlock(i, layer.mlp, config, split)
    return blocks
