"""A tiny random-weight Qwen2.5-VL or Qwen3-VL (and the files that let a tiny Qwen3.5 take
images: tiny.py), from its real config classes, for offline tests: the text stack at the
tiny text models' widths, a small vision tower, a tokenizer with the vision special tokens,
and the image processor's preprocessor_config.json (small images: at most 8 x 8 merge units
of 28 pixels (Qwen2.5-VL's 14-pixel patches) or 32 (Qwen3-VL's and Qwen3.5's 16-pixel
ones))."""

from __future__ import annotations

import json
from pathlib import Path

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
ARCHS = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
# Qwen2-VL / Qwen2.5-VL's chat template (as its checkpoints ship it): one <|image_pad|> per
# image part, which the processor (here: the OpenAI face, openai_shim/images.py) expands to
# the image's token count.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def token_ids(tokenizer) -> dict:
    """A VL config's vision token ids, as add_vision_tokens gave them."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    return dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                vision_start_token_id=ids["<|vision_start|>"],
                vision_end_token_id=ids["<|vision_end|>"])


def vl_config(arch: str, common: dict, tokenizer, moe: dict | None = None):
    """The nested config of a tiny `arch` (ARCHS) model; `moe`: qwen3_vl_moe's expert
    sizes (every layer sparse, as the released ones)."""
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig, Qwen3VLMoeConfig

    head_dim = common["hidden_size"] // common["num_attention_heads"]
    half = head_dim // 2  # mRoPE's three sections split the rotary half: t, h, w
    section = [half - 2 * (half // 3), half // 3, half // 3]
    rope = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": section}
    if arch == "qwen2_5_vl":
        make, text = Qwen2_5_VLConfig, dict(common, rope_parameters=rope)
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                      out_hidden_size=common["hidden_size"], fullatt_block_indexes=[1],
                      window_size=56, tokens_per_second=2)
    else:  # Qwen3-VL: q/k norms, interleaved mRoPE, 16-pixel patches, DeepStack
        make = Qwen3VLConfig if arch == "qwen3_vl" else Qwen3VLMoeConfig
        text = dict(common, head_dim=head_dim, **(moe or {}),
                    rope_parameters=dict(rope, rope_theta=5_000_000.0, mrope_interleaved=True))
        # DeepStack from two of the three blocks: the first two text layers get features
        # added, a third (where the model has one) none, as the 8B's 3 of 36.
        vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                      out_hidden_size=common["hidden_size"], num_position_embeddings=16,
                      deepstack_visual_indexes=[0, 2])
    return make(text_config=text, vision_config=vision, **token_ids(tokenizer),
                tie_word_embeddings=common["tie_word_embeddings"],
                eos_token_id=common["eos_token_id"])


def add_vision_tokens(tokenizer, out: Path, arch: str = "qwen2_5_vl") -> None:
    """The vision special tokens (new ids past the BPE vocabulary) and the processor config
    (as the released checkpoints' preprocessor_config.json: Qwen2.5-VL's CLIP normalisation,
    Qwen3-VL's and Qwen3.5's 0.5s and 16-pixel patches)."""
    tokenizer.add_tokens(VISION_TOKENS, special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out))
    if arch == "qwen2_5_vl":
        unit, norm = 28, {"image_mean": [0.48145466, 0.4578275, 0.40821073],
                          "image_std": [0.26862954, 0.26130258, 0.27577711]}
        sizes = {"patch_size": 14, "min_pixels": unit**2, "max_pixels": unit**2 * 64}
    else:
        unit, norm = 32, {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
        sizes = {"patch_size": 16, "size": {"shortest_edge": unit**2,
                                            "longest_edge": unit**2 * 64}}
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "merge_size": 2,
        "temporal_patch_size": 2, **sizes, **norm}))


def build_model(config):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_config(config)
