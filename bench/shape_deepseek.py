"""DeepSeek-V3's shape for the benchmarks (its config.json's numbers; Kimi-K2 has the same
layers with 384 experts and 64 heads), at a reduced depth: one H200 holds 4 layers (the
first 3 dense, as released, then 1 MoE layer of 256 experts): about 15B parameters, 30 GB
in bf16, most of it the MoE layer's experts (11.3B)."""

from __future__ import annotations

LAYERS = 4  # 3 dense + 1 MoE


def deepseek_v3(layers: int | None = None):
    from transformers import DeepseekV3Config

    n = layers or LAYERS
    return DeepseekV3Config(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=n, num_attention_heads=128,
        num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
        routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
        v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
        num_experts_per_tok=8, first_k_dense_replace=min(3, n - 1), norm_topk_prob=True,
        max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
