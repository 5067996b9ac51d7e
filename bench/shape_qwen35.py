"""The Qwen3.5 shapes for bench_engine.py / bench_multitenant.py (random weights): the 9B
dense text model and the 35B-A3B mixture of experts."""

from __future__ import annotations

# Qwen3.5-35B-A3B's first 12 of 40 layers (three full-attention ones), unless --layers says:
# 8 rank-32 adapters on all 256 experts of every layer (46M parameters a layer each, 18
# bytes a parameter with gradients and moments) and its bf16 weights fit one H200 so.
MOE_LAYERS = 12


def qwen35_9b(layers: int | None = None):
    """Qwen3.5-9B's text model (its config.json's text_config numbers): 32 layers, full
    attention every 4th, linear attention with 16 key and 32 value heads of 128."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=layers or 32, num_attention_heads=16, num_key_value_heads=4,
        head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_conv_kernel_dim=4,
        max_position_embeddings=262144, tie_word_embeddings=False, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                         "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                         "mrope_interleaved": True})


def qwen35_35b_a3b(layers: int):
    """Qwen3.5-35B-A3B's text model (transformers' Qwen3_5MoeTextConfig defaults are its
    numbers): hidden 2048, 16 query / 2 kv heads of 256 on full-attention layers (every 4th),
    linear attention as the 9B's; 256 experts of 512, top-8, and a shared expert of 512."""
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        num_hidden_layers=layers, max_position_embeddings=262144, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                         "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                         "mrope_interleaved": True})


def torch_rule_for_peft() -> None:
    """Plain peft's Qwen3.5 (transformers' own modules) trains by transformers' torch delta
    rule where fla-core refuses its gated backward (Hopper under Triton < 3.7.1, as the
    engine does: twinkled/engine/linear_attn.py): transformers binds fla's kernel when its
    module is imported, and on such a card the baseline spent minutes autotuning that
    kernel's forward only to have its backward refused. Elsewhere both keep fla."""
    import importlib

    from twinkled.engine.linear_attn import fla_backward_broken

    if not fla_backward_broken():
        return
    for name in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        try:
            m = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        except ImportError:
            continue
        rule = getattr(m, "torch_chunk_gated_delta_rule", None)
        if rule is not None and hasattr(rule, "__wrapped__"):  # (the hub/fla wrapper)
            m.torch_chunk_gated_delta_rule = rule.__wrapped__
