"""Qwen3.5-MoE (`qwen3_5_moe`) and Qwen3-Next (`qwen3_next`): Qwen3.5's hybrid layers (qwen35.py) with a sparse MLP in
every layer, as Qwen3.5-35B-A3B ... 397B-A17B have it (Qwen3-Next-80B-A3B: in the layers its
config makes sparse).

The sparse block (transformers' Qwen3_5MoeSparseMoeBlock) is two parts added together:
- routed experts: a router (softmax over the E experts in fp32, top-k, the k weights
  renormalised: always for Qwen3.5-MoE, per `norm_topk_prob` for Qwen3-Next) and experts held fused, `experts.gate_up_proj` [E, 2I, H] and
  `experts.down_proj` [E, H, I] (the released files hold them expert by expert under
  model.language_model.*; transformers fuses them as it loads). They run in moe.py, a LoRA
  pair per expert, as Qwen3-MoE's do;
- a shared expert: a SwiGLU MLP every token takes (`shared_expert.gate/up/down_proj`),
  scaled by sigmoid(shared_expert_gate(x)), a [1, H] linear. It runs as a dense layer's MLP
  (BaseModel.mlp), so its three linears take LoRA as any MLP's.
LoRA targets under `train_mlp`: the experts' two parameters (peft's target_parameters form,
moe_peft.py) and the shared expert's gate/up/down_proj (peft's target_modules by those
names). The router and the shared expert's gate (one output) are not targets: peft's
target_modules of the same names leave them alone too. Qwen3-Next: the experts alone
(`untargetable`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from twinkled.protocol.types import MLP_MODULES

# Qwen3-Next (`qwen3_next`, text only) is the same family: its sparse blocks are these (a
# config's `mlp_only_layers` / `decoder_sparse_step` leave some layers dense), its linear
# attention fuses its input projections (qwen35.py `projections`).
ARCHS = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")


def shared_keys(i: int, layer) -> dict[str, str]:
    """Layer i's shared-expert linears, by the MLP names the adapters select them by
    ({} for a layer without one)."""
    if not hasattr(layer.mlp, "shared_expert"):
        return {}
    return {n: f"model.layers.{i}.mlp.shared_expert.{n}" for n in MLP_MODULES}


def sparse_mlp(model, i: int, mlp, x: torch.Tensor, keys: dict[str, str], lora, banks
               ) -> torch.Tensor:
    """The sparse block's output on the normed x [B, S, H]: routed experts (`model.moe[i]`,
    whose split over expert-parallel ranks brings its own collectives) plus the gated
    shared expert (replicated: every rank computes it whole)."""
    routed = model.moe[i](x, banks)
    gate = torch.sigmoid(F.linear(x, mlp.shared_expert_gate.weight))
    return routed + gate * model.mlp(i, mlp.shared_expert, x, keys, lora)


def untargetable(model_type: str, targets: dict) -> list[str]:
    """Qwen3-Next's MLP linears (shared experts', dense layers'): peft 0.21 reads the
    target_modules gate_proj / up_proj / down_proj of this model family (whose v4 checkpoints
    transformers converts as Qwen2-MoE's) as the experts' old names and adapts the experts'
    parameters instead, so an adapter on those linears would not load in peft. Its
    `train_mlp` adapts the experts alone. (Qwen3.5-MoE's conversion renames no expert.)"""
    if model_type != "qwen3_next":
        return []
    return [k for k in targets if k.rsplit(".", 1)[-1] in MLP_MODULES and ".experts." not in k]
