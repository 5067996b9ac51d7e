"""The gpt-oss-20b shape for bench_engine.py / bench_multitenant.py (random weights).

gpt-oss-20b's config.json numbers: 24 layers alternating sliding (128) and full attention,
64 query and 8 kv heads of 64, 32 experts of intermediate 2880, top-4, YaRN x32 over 4096.
In bf16 (experts dequantised, as mxfp4.py loads the release) it is ~42 GB: it fits one
80 GB card for training with LoRA; `--layers N` cuts it.
"""

from __future__ import annotations

NAME = "gpt-oss-20b"


def config(layers: int | None = None):
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880,
        num_hidden_layers=layers or 24, num_attention_heads=64, num_key_value_heads=8,
        head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        max_position_embeddings=131072, tie_word_embeddings=False, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                         "original_max_position_embeddings": 4096})


def active_params(hf) -> int:
    """The parameters one token uses (MFU's N): all but the experts it is not routed to."""
    cfg = hf.config
    total = sum(p.numel() for p in hf.parameters())
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n)
    return int(total - experts * (1 - cfg.num_experts_per_tok / cfg.num_local_experts))


def peft_kwargs(model_dir) -> dict:
    """peft's baseline on gpt-oss: the experts as target_parameters too (our train_mlp),
    and transformers' eager attention (its gpt-oss takes no sdpa: sinks)."""
    from transformers import AutoConfig

    if AutoConfig.from_pretrained(model_dir).model_type != "gpt_oss":
        return {}
    return {"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}


def attn_implementation(model_dir) -> str:
    from transformers import AutoConfig

    return "eager" if AutoConfig.from_pretrained(model_dir).model_type == "gpt_oss" else "sdpa"

