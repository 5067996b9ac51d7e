"""A tiny random-weight Qwen2.5-VL, from its real config classes, for offline tests: the text
stack at the tiny text models' widths, a one-block vision tower, a tokenizer with the vision
special tokens, and the image processor's preprocessor_config.json (small images: 28-pixel
merge units, at most 8 x 8 of them)."""

from __future__ import annotations

import json
from pathlib import Path

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
MIN_PIXELS, MAX_PIXELS = 28 * 28, 28 * 28 * 64
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


def qwen25vl_config(common: dict, tokenizer):
    from transformers import Qwen2_5_VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    head_dim = common["hidden_size"] // common["num_attention_heads"]
    half = head_dim // 2  # mRoPE's three sections split the rotary half: t, h, w
    section = [half - 2 * (half // 3), half // 3, half // 3]
    text = dict(common, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0,
                                         "mrope_section": section})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=common["hidden_size"], fullatt_block_indexes=[1],
                  window_size=56, tokens_per_second=2)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                            image_token_id=ids["<|image_pad|>"],
                            video_token_id=ids["<|video_pad|>"],
                            vision_start_token_id=ids["<|vision_start|>"],
                            vision_end_token_id=ids["<|vision_end|>"],
                            tie_word_embeddings=common["tie_word_embeddings"],
                            eos_token_id=common["eos_token_id"])


def add_vision_tokens(tokenizer, out: Path) -> None:
    """The vision special tokens (new ids past the BPE vocabulary) and the processor config."""
    tokenizer.add_tokens(VISION_TOKENS, special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out))
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14, "merge_size": 2,
        "temporal_patch_size": 2, "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711]}))


def build_model(config):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration(config)
