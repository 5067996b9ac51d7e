"""MXFP4 checkpoints (gpt-oss as released): the experts dequantised on load.

The format (OCP microscaling FP4): each expert weight is stored as `<name>_blocks`
[E, rows, G, 16] uint8, two 4-bit E2M1 values a byte (low nibble first), and
`<name>_scales` [E, rows, G] uint8, one power-of-two exponent (biased by 127) per group of
32 values. Value = E2M1(nibble) * 2^(scale - 127); the G groups of a row, end to end, are
the row's `in` values, so the whole tensor is [E, rows, in], which transformers holds
transposed ([E, in, rows]: GptOssExperts' gate_up_proj [E, H, 2I], down_proj [E, I, H]).

We dequantise to the model's dtype (bf16 on a GPU: the training path's grouped matmuls and
the LoRA deltas want plain tensors), one expert at a time to bound the memory the index
tensors take, then build the model on the meta device and assign the tensors into it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# E2M1: the sixteen values a nibble encodes.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def quantized(config) -> bool:
    """Whether a checkpoint's config says its weights are MXFP4."""
    q = getattr(config, "quantization_config", None) or {}
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    return str(method).lower().endswith("mxfp4")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [E, rows, G, 16] uint8, scales [E, rows, G] uint8 -> [E, G * 32, rows] in
    `dtype` (transformers' [E, in, out] layout)."""
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    out = []
    for b, s in zip(blocks, scales, strict=True):  # one expert at a time
        b = b.to(torch.uint8)
        pairs = torch.stack([lut[(b & 0x0F).long()], lut[(b >> 4).long()]], dim=-1)
        vals = torch.ldexp(pairs.reshape(*b.shape[:-1], -1),
                           (s.to(torch.int32) - 127)[..., None]).to(dtype)
        out.append(vals.reshape(b.shape[0], -1).t())
    return torch.stack(out).contiguous()


def read_state(model_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's safetensors files, MXFP4 pairs dequantised. Tensors
    are read one at a time (a pair's blocks and scales may sit in different shards), so the
    host holds the dequantised model and one packed tensor, not the packed model too."""
    from safetensors import safe_open

    files = [safe_open(str(p), framework="pt") for p in sorted(model_dir.glob("*.safetensors"))]
    where = {key: f for f in files for key in f.keys()}  # noqa: SIM118 - safe_open's API
    out = {}
    for key, f in where.items():
        if key.endswith("_scales"):
            continue
        if key.endswith("_blocks"):
            name = key.removesuffix("_blocks")
            scales = where[name + "_scales"].get_tensor(name + "_scales")
            out[name] = dequantize(f.get_tensor(key), scales, dtype)
        else:
            out[key] = f.get_tensor(key).to(dtype)
    return out


def load_dequantized(model_dir: str | Path, config, dtype: torch.dtype):
    """The causal LM of an MXFP4 checkpoint with every weight in `dtype`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    raw.pop("quantization_config", None)
    plain = AutoConfig.for_model(**raw)
    for key in ("rope_parameters", "max_position_embeddings"):  # as scaled by the caller
        if hasattr(config, key):
            setattr(plain, key, getattr(config, key))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(plain, dtype=dtype)
    state = read_state(model_dir, dtype)
    if plain.tie_word_embeddings and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    # Buffers computed at init (the rotary frequencies) are not in the checkpoint: again.
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(plain)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"MXFP4 checkpoint {model_dir} lacks {left[:4]}")
    return model
