"""The Qwen2.5-VL-7B shape for bench_multitenant.py (`--shape qwen2.5-vl-7b`): a random-weight
checkpoint of its sizes, each tenant's datums one image + S text tokens, and plain
transformers + peft on the same 8 datums in-process (the bound the daemon is held to).

    python bench/bench_multitenant.py --shape qwen2.5-vl-7b --tenants 1,8 --packed-baseline
"""

from __future__ import annotations

import io
import time
from pathlib import Path

IMAGE_PX = 448  # 448 x 448 pixels: 16 x 16 merged patches, 256 image tokens
TEXT_FLOOR = 2048  # random text ids start here: clear of the tokenizer's special ids


def build(out: Path, dtype, device: str) -> tuple[int, int]:
    """Write the checkpoint (+ tokenizer, processor config); return (vocab, image tokens)."""
    import json

    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from twinkled.engine import tiny_vl
    from twinkled.engine.tiny import build_tokenizer
    from twinkled.protocol.images import VisionSpec, image_tokens

    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    tiny_vl.add_vision_tokens(tok, out)
    raw = json.loads((out / "preprocessor_config.json").read_text())
    raw["max_pixels"] = 28 * 28 * 1280  # the released checkpoint's
    (out / "preprocessor_config.json").write_text(json.dumps(raw))
    ids = {t: tok.convert_tokens_to_ids(t) for t in tiny_vl.VISION_TOKENS}
    text = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                max_position_embeddings=32768, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                 "mrope_section": [16, 24, 24]})
    vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                  out_hidden_size=3584, fullatt_block_indexes=[7, 15, 23, 31],
                  window_size=112, tokens_per_second=2)
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                           image_token_id=ids["<|image_pad|>"],
                           video_token_id=ids["<|video_pad|>"],
                           vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"],
                           tie_word_embeddings=False, eos_token_id=tok.eos_token_id)
    with torch.device(device):  # random init on the card: fast for 8B
        model = Qwen2_5_VLForConditionalGeneration(cfg).to(dtype)
    model.save_pretrained(str(out))
    del model
    grid = image_tokens(IMAGE_PX, IMAGE_PX, VisionSpec.from_dir(out))
    return 152064, grid[0] * grid[1] * grid[2] // 4


def image_bytes(seed: int) -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (IMAGE_PX, IMAGE_PX, 3), dtype=np.uint8)).save(
        buf, "PNG")
    return buf.getvalue()


def datum(rng, vocab: int, seq: int, image_tokens: int, seed: int):
    """One image + `seq` text tokens (tinker's types); the image's positions weigh 0."""
    import tinker

    ids = [rng.randrange(TEXT_FLOOR, vocab) for _ in range(seq + 1)]
    chunks = [tinker.types.ImageChunk(data=image_bytes(seed), format="png",
                                      expected_tokens=image_tokens),
              tinker.types.EncodedTextChunk(tokens=ids[:-1])]
    return tinker.types.Datum(model_input=tinker.types.ModelInput(chunks=chunks),
                              loss_fn_inputs={"target_tokens": [0] * image_tokens + ids[1:],
                                              "weights": [0.0] * image_tokens + [1.0] * seq})


def peft_baseline(model_dir: Path, dtype, device: str, seq: int, rows: int = 8,
                  steps: int = 5) -> float:
    """Text tokens/s of transformers + peft (LoRA r=32 on the language model's linears)
    training `rows` datums of one image + `seq` tokens as one batch."""
    import torch
    from peft import LoraConfig, get_peft_model
    from PIL import Image
    from transformers import AutoImageProcessor, Qwen2_5_VLForConditionalGeneration

    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=dtype,
                                                            attn_implementation="sdpa")
    targets = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    model = get_peft_model(hf.to(device), LoraConfig(r=32, lora_alpha=32,
                                                     target_modules=targets))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    proc = AutoImageProcessor.from_pretrained(model_dir, use_fast=False)
    px = proc(images=[Image.open(io.BytesIO(image_bytes(i))) for i in range(rows)],
              return_tensors="pt")
    n = int(px["image_grid_thw"][0].prod()) // 4
    pad = hf.config.image_token_id
    gen = torch.Generator().manual_seed(0)
    text = torch.randint(TEXT_FLOOR, hf.config.text_config.vocab_size, (rows, seq), generator=gen)
    ids = torch.cat([torch.full((rows, n), pad), text], 1).to(device)
    labels = ids.masked_fill(ids == pad, -100)
    kw = dict(pixel_values=px["pixel_values"].to(device, dtype),
              image_grid_thw=px["image_grid_thw"].to(device),
              mm_token_type_ids=(ids == pad).int())

    def step() -> None:
        model(input_ids=ids, labels=labels, **kw).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    return rows * seq * steps / (time.perf_counter() - t0)
