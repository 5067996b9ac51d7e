"""A tiny gpt-oss checkpoint (tiny.py's build_tiny_model(arch="gpt_oss")): the real config
class and layer pattern (sliding and full attention alternating, every layer sparse,
attention biases and sinks, YaRN rope) at small widths; with `mxfp4`, the experts stored
as released (`*_blocks`/`*_scales`, quantization_config), values exactly representable."""

from __future__ import annotations

from pathlib import Path

import torch


def gpt_oss_config(common: dict, head_dim: int, num_experts: int, experts_per_token: int,
                   sliding_window: int = 8):
    from transformers import GptOssConfig

    # YaRN as released (factor 32 over the original context), the original context scaled
    # down so that factor x original = the tiny model's context.
    rope = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "rope_theta": 150000.0,
            "original_max_position_embeddings": common["max_position_embeddings"] // 32}
    return GptOssConfig(**common, head_dim=head_dim, num_local_experts=num_experts,
                        num_experts_per_tok=experts_per_token, sliding_window=sliding_window,
                        rope_parameters=rope)


def randomize(model, seed: int) -> None:
    """Non-zero biases and sinks (transformers initialises them to zero or near it), so a
    test that dropped any of them would fail."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "_bias", "router.bias", "router.weight")) or (
                    name.endswith("bias") and "self_attn" in name):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def quantize_experts(out: Path, model) -> None:
    """Rewrite the saved checkpoint with MXFP4 experts: each weight rounded to E2M1 values
    with one exponent per 32 (the format mxfp4.py reads); the config says so."""
    import json

    from safetensors.torch import save_file

    from .mxfp4 import FP4_VALUES

    lut = torch.tensor(FP4_VALUES[:8])
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = state.pop(key).transpose(1, 2).float()  # [E, out, in]
        E, rows, cols = w.shape
        g = w.reshape(E, rows, cols // 32, 32)
        exp = torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
        scaled = g / torch.exp2(exp)[..., None]
        nib = (scaled.abs()[..., None] - lut).abs().argmin(-1) + 8 * (scaled < 0)
        nib = nib.to(torch.uint8).reshape(E, rows, cols // 32, 16, 2)
        state[key + "_blocks"] = (nib[..., 0] | (nib[..., 1] << 4)).contiguous()
        state[key + "_scales"] = (exp + 127).to(torch.uint8).contiguous()
    for f in out.glob("*.safetensors"):
        f.unlink()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn",
                                                             "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
