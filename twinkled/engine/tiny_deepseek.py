"""A tiny DeepSeek-V3 checkpoint (random weights, the real config class and layer pattern).

The released models' choices at small widths: MLA with a q LoRA rank (q_a/q_b), interleaved
rope on the decoupled rotary dims, YaRN with mscale_all_dim (so the softmax scale carries
the mscale), the first layer dense then MoE layers of routed experts in groups (grouped
top-k, sigmoid scores with a non-zero correction bias, routed_scaling_factor) plus one
shared expert.
"""

from __future__ import annotations


def deepseek_config(common: dict):
    from transformers import DeepseekV3Config

    kw = dict(common)
    kw.pop("num_key_value_heads", None)  # MLA: every head has its own keys
    return DeepseekV3Config(
        **kw, num_key_value_heads=kw["num_attention_heads"],
        moe_intermediate_size=kw["intermediate_size"] // 4, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=8,
        v_head_dim=16, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 512, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})


def spread_router(model) -> None:
    """A router bias that matters (the released models' is far from zero)."""
    import torch

    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.3)
