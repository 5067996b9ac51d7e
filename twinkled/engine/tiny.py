"""Build a tiny random-weight causal LM and a tokenizer offline, in about a second.

Tests, the demo and CPU benchmarks use it: no hub access is needed anywhere. The result is
an ordinary Hugging Face directory (config, safetensors weights, tokenizer files with a
ChatML chat template), loaded through the same code path as a real checkpoint.
"""

from __future__ import annotations

import random
from pathlib import Path

from . import tiny_vl

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

# ChatML, as Qwen models use it. The assistant turn is wrapped in {% generation %} so that
# `return_assistant_tokens_mask=True` can find the tokens that training labels.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_WORDS = (
    "the a an of to and in is it you that he was for on are with as I his they be at one "
    "have this from or had by hot word but what some we can out other were all there when "
    "up use your how said each she which do their time if will way about many then them "
    "write would like so these her long make thing see him two has look more day could go "
    "come did number sound no most people my over know water than call first who may down "
    "side been now find any new work part take get place made live where after back little "
    "only round man year came show every good me give our under name very through just form "
    "sentence great think say help low line differ turn cause much mean before move right boy "
    "old too same tell does set three want air well also play small end put home read hand "
    "port large spell add even land here must big high such follow act why ask men change "
    "went light kind off need house picture try us again animal point mother world near build "
    "self earth father head stand own page should country found answer school grow study still "
    "learn plant cover food sun four between state keep eye never last let thought city tree "
    "cross farm hard start might story saw far sea draw left late run while press close night "
    "real life few north assistant user system model twinkle train sample adapter tenant "
    "question reply hello yes zero five six seven eight nine ten plus minus equals"
).split()


def _corpus(n_lines: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 14))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 999)))
        line = " ".join(words)
        lines.append(line.capitalize() + rng.choice([".", "?", "!", ","]))
    return lines


def build_tokenizer(out_dir: str | Path, vocab_size: int = 1024):
    """Train a byte-level BPE tokenizer on a generated corpus and save it as a HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 2048
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_model(
    out_dir: str | Path,
    arch: str = "qwen3",
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 256,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    embed_std: float = 0.2,
    num_experts: int = 8,
    experts_per_token: int = 2,
    vocab_size: int = 1024,
    images: bool = False,
) -> Path:
    """Write a tiny random-weight model of `arch` (qwen3, qwen2, llama, qwen3_moe with
    `num_experts` experts of which each token uses `experts_per_token`, qwen3_5 /
    qwen3_5_moe: a Qwen3.5 (-MoE) checkpoint as released, `qwen35_config`, or qwen3_next,
    `qwen3_next_config`) plus tokenizer.

    head_dim is hidden/heads (64 by default), which vLLM's CPU build also accepts.
    Vision-language: qwen2_5_vl, qwen3_vl, qwen3_vl_moe (tiny_vl.py), and qwen3_5 / qwen3_5_moe with
    `images` (the vision tokens and image processor files that make it take images).
    """
    import torch
    from transformers import (
        AutoModelForCausalLM,
        LlamaConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, vocab_size)
    images = arch in tiny_vl.ARCHS or (images and arch.startswith("qwen3_5"))
    if images:  # its vision tokens, ids past the BPE vocabulary (tiny_vl.py)
        tiny_vl.add_vision_tokens(tokenizer, out, arch)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    if arch == "qwen3":
        config = Qwen3Config(head_dim=hidden_size // num_heads, **common)
    elif arch == "qwen3_moe":  # Qwen3-30B-A3B's choices: renormalised top-k, every layer sparse
        config = Qwen3MoeConfig(head_dim=hidden_size // num_heads, num_experts=num_experts,
                                num_experts_per_tok=experts_per_token, norm_topk_prob=True,
                                moe_intermediate_size=intermediate_size // 4, **common)
    elif arch == "qwen2":
        config = Qwen2Config(**common)
    elif arch == "llama":
        config = LlamaConfig(head_dim=hidden_size // num_heads, **common)
    elif arch == "qwen3_5":
        config = qwen35_config(common, hidden_size // num_heads,
                               vision=tokenizer if images else None)
    elif arch == "qwen3_5_moe":  # Qwen3.5-35B-A3B's: routed experts and a gated shared one
        config = qwen35_config(common, hidden_size // num_heads, moe=dict(
            num_experts=num_experts, num_experts_per_tok=experts_per_token,
            moe_intermediate_size=intermediate_size // 4,
            shared_expert_intermediate_size=intermediate_size // 2),
            vision=tokenizer if images else None)
    elif arch == "qwen3_next":  # Qwen3-Next's: text only, layer 1 dense (mlp_only_layers)
        config = qwen3_next_config(common, hidden_size // num_heads, num_experts,
                                   experts_per_token)
    elif arch == "deepseek_v3":  # MLA + grouped-routing MoE (tiny_deepseek.py)
        from .tiny_deepseek import deepseek_config as config_of

        config = config_of(common)
    elif arch == "gpt_oss":  # tiny_gpt_oss.py
        from .tiny_gpt_oss import gpt_oss_config

        config = gpt_oss_config(common, hidden_size // num_heads, num_experts, experts_per_token)
    elif arch in tiny_vl.ARCHS:
        config = tiny_vl.vl_config(arch, common, tokenizer, moe=dict(
            num_experts=num_experts, num_experts_per_tok=experts_per_token,
            moe_intermediate_size=intermediate_size // 4) if arch.endswith("_moe") else None)
    else:
        raise ValueError("arch must be qwen3, qwen2, llama, qwen3_moe, qwen3_5, qwen3_5_moe, "
                         f"qwen3_next, deepseek_v3, gpt_oss, qwen2_5_vl, qwen3_vl or qwen3_vl_moe, "
                         f"not {arch!r}")
    torch.manual_seed(seed)
    if arch.startswith("qwen3_5"):  # the whole checkpoint, vision tower included, as released
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_config(config).to(torch.float32)
    elif arch in tiny_vl.ARCHS:
        model = tiny_vl.build_model(config).to(torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init with std 0.02 gives near-uniform logits; a larger spread (the default 0.2)
    # makes the tiny model's next-token distribution peaked enough for greedy/stop tests to be
    # meaningful. RL demos want the opposite: varied samples, so that rewards differ.
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0.0, embed_std)
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # a router that prefers some experts
                p.normal_(0.0, 0.5)
        if arch == "deepseek_v3":
            from .tiny_deepseek import spread_router

            spread_router(model)
    if arch == "gpt_oss":  # its biases and sinks non-zero
        from .tiny_gpt_oss import randomize

        randomize(model, seed)
    model.save_pretrained(str(out))
    return out


def qwen35_config(common: dict, head_dim: int, moe: dict | None = None, vision=None):
    """Qwen3.5's nested config (text_config + a vision tower), at tiny widths: the real
    layer pattern (full attention every 4th layer; the last one where there are fewer than
    4), linear attention with twice as many value heads as key heads (as the 9B has), and
    Qwen3.5's partial rotary and multimodal rope parameters. `moe`: Qwen3.5-MoE's config
    (qwen3_5_moe) with these expert sizes, every layer's MLP sparse. `vision`: the tokenizer
    holding the vision tokens (tiny_vl.py) of a model that takes images: their ids, and the
    released models' 16-pixel patches."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    n = common["num_hidden_layers"]
    kinds = ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(n)]
    if "full_attention" not in kinds:
        kinds[-1] = "full_attention"
    text = dict(common, head_dim=head_dim, layer_types=kinds, linear_conv_kernel_dim=4,
                linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
                linear_num_value_heads=4,
                rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                                 "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                                 "mrope_interleaved": True})
    tower = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                 patch_size=4 if vision is None else 16,
                 out_hidden_size=common["hidden_size"], num_position_embeddings=16)
    if moe is not None:
        text = {k: v for k, v in text.items() if k != "intermediate_size"} | moe
    ids = {} if vision is None else tiny_vl.token_ids(vision)
    return (Qwen3_5Config if moe is None else Qwen3_5MoeConfig)(
        text_config=text, vision_config=tower, tie_word_embeddings=common["tie_word_embeddings"],
        eos_token_id=common["eos_token_id"], **ids)


def qwen3_next_config(common: dict, head_dim: int, experts: int, top_k: int):
    """Qwen3-Next's config at tiny widths: Qwen3.5's layer pattern and linear attention (its
    fused projections), partial rotary, sparse layers with a shared expert but layer 1 dense."""
    from transformers import Qwen3NextConfig

    n = common["num_hidden_layers"]
    kinds = ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(n)]
    kinds[-1] = "full_attention"
    inter = common["intermediate_size"]
    return Qwen3NextConfig(**common, head_dim=head_dim, layer_types=kinds, linear_conv_kernel_dim=4,
                           linear_key_head_dim=32, linear_value_head_dim=32,
                           linear_num_key_heads=2, linear_num_value_heads=4,
                           partial_rotary_factor=0.25, num_experts=experts,
                           num_experts_per_tok=top_k, norm_topk_prob=True,
                           moe_intermediate_size=inter // 4,
                           shared_expert_intermediate_size=inter // 2, mlp_only_layers=[1])
