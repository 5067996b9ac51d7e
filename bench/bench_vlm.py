"""The Qwen2.5-VL-7B and Qwen3-VL-8B shapes for bench_multitenant.py (`--shape qwen2.5-vl-7b`,
`--shape qwen3-vl-8b`): a random-weight checkpoint of its sizes, each tenant's datums one
image + S text tokens, and plain transformers + peft on the same 8 datums in-process (the
bound the daemon is held to).

    python bench/bench_multitenant.py --shape qwen2.5-vl-7b --tenants 1,8 --packed-baseline
    python bench/bench_multitenant.py --shape qwen3-vl-8b --tenants 1,8 --packed-baseline
"""

from __future__ import annotations

import io
import time
from pathlib import Path

# 448 x 448 pixels: 16 x 16 merged patches of 28 px (256 image tokens) on Qwen2.5-VL,
# 14 x 14 of 32 px (196) on Qwen3-VL
IMAGE_PX = 448
TEXT_FLOOR = 2048  # random text ids start here: clear of the tokenizer's special ids


def _config(shape: str, ids: dict, eos: int):
    """The released model's sizes (its config.json), with the tiny tokenizer's vision ids."""
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig

    if shape == "qwen2.5-vl-7b":
        make = Qwen2_5_VLConfig
        text = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                    num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                    max_position_embeddings=32768, rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                     "mrope_section": [16, 24, 24]})
        vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                      out_hidden_size=3584, fullatt_block_indexes=[7, 15, 23, 31],
                      window_size=112, tokens_per_second=2)
    else:
        make = Qwen3VLConfig
        text = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                    num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=128, max_position_embeddings=262144, rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                     "mrope_section": [24, 20, 20],
                                     "mrope_interleaved": True})
        vision = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                      patch_size=16, out_hidden_size=4096, num_position_embeddings=2304,
                      deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh")
    return make(text_config=text, vision_config=vision, **ids, tie_word_embeddings=False,
                eos_token_id=eos)


def build(out: Path, dtype, device: str, shape: str = "qwen2.5-vl-7b") -> tuple[int, int]:
    """Write the checkpoint (+ tokenizer, processor config); return (vocab, image tokens)."""
    import json

    import torch
    from transformers import AutoModelForImageTextToText

    from twinkled.engine import tiny_vl
    from twinkled.engine.tiny import build_tokenizer
    from twinkled.protocol.images import VisionSpec, image_tokens

    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    arch = "qwen2_5_vl" if shape == "qwen2.5-vl-7b" else "qwen3_vl"
    tiny_vl.add_vision_tokens(tok, out, arch)
    raw = json.loads((out / "preprocessor_config.json").read_text())
    if arch == "qwen2_5_vl":
        raw["max_pixels"] = 28 * 28 * 1280  # the released checkpoint's
    else:
        raw["size"] = {"shortest_edge": 65536, "longest_edge": 16777216}
    (out / "preprocessor_config.json").write_text(json.dumps(raw))
    cfg = _config(shape, tiny_vl.token_ids(tok), tok.eos_token_id)
    with torch.device(device):  # random init on the card: fast for 8B
        model = AutoModelForImageTextToText.from_config(cfg).to(dtype)
    model.save_pretrained(str(out))
    del model
    spec = VisionSpec.from_dir(out)
    grid = image_tokens(IMAGE_PX, IMAGE_PX, spec)
    return cfg.text_config.vocab_size, grid[0] * grid[1] * grid[2] // spec.merge_size**2


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
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype,
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
