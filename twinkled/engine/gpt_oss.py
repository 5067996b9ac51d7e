"""gpt-oss (transformers `gpt_oss`): the Llama-family layer with three differences.

- Attention sinks (attn_sinks.py): each head's learned logit joins the softmax denominator.
- Alternating sliding-window and full attention (sliding_window.py): `config.layer_types`
  names each layer's kind, `config.sliding_window` the window; the KV pages keep every key.
- Sparse MLP on every layer (gpt_oss_moe.py): a router with a bias, softmax over the top-k
  logits, experts with biases and a clamped SwiGLU.
q/k/v/o carry biases (F.linear takes them as Qwen2's do) and rotary is YaRN, which
transformers' rotary module computes from the config (its cos/sin cover half a head; we
repeat them so fused_ops.rope takes them as the Llama family's).

BaseModel (model.py) runs the layers as for the Llama family and calls `SinkAttention.attend`
for the attention itself. Every path runs attn_sinks.attend (SDPA, the sink as an extra
key) under sliding_window's masks: training rows,
packed segments (the window applies per segment: positions restart), the sampler's prefill
pieces, and decode, which takes the gathered pages (`cache.write`) even where the Triton
paged kernel would run (it has no sink term or window yet). Released checkpoints store the
experts in MXFP4 (mxfp4.py dequantises them on load).

Tensor parallelism splits attention as for the Llama family (tp.py: whole heads per rank,
q/k/v biases with their rows, o_proj's bias added once) and each rank keeps the sinks of
its own heads (tp_load.py); the experts are split over the same group, whole, as --ep
splits them (gpt_oss_moe.py, moe_parallel.py).

LoRA targets: q_proj, k_proj, v_proj, o_proj (train_attn); the experts' gate_up_proj and
down_proj, one pair per expert (train_mlp; moe.py); lm_head (train_unembed). The router
and sinks stay frozen.
"""

from __future__ import annotations

import torch

from twinkled.protocol.types import EngineInputError

from . import attn_sinks, sliding_window
from .packed import Packing

ARCHS = ("gpt_oss",)


class _FullRotary(torch.nn.Module):
    """transformers' gpt-oss rotary gives cos/sin for half a head (it rotates the halves);
    the Llama form wants them repeated over the whole head: the same rotation."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor, positions: torch.Tensor):
        cos, sin = self.inner(x, positions)
        return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


class SinkAttention:
    """Each layer's sinks and window, and the attention over them."""

    def __init__(self, model):
        config = model.config
        kinds = list(config.layer_types)
        self.windows = [config.sliding_window if kind == "sliding_attention" else None
                        for kind in kinds]
        self.sinks = [layer.self_attn.sinks for layer in model.layers]
        self.rotary = _FullRotary(model.decoder.rotary_emb)  # (HF's own module untouched)

    def attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               cache, mask, packing) -> torch.Tensor:
        """Layer i's attention of rotated q [B, H, S, D] over k, v [B, Hkv, S, D] (stored in
        `cache` first) -> [B, S, H * D]."""
        B, S = q.shape[0], q.shape[2]
        window, sinks = self.windows[i], self.sinks[i]
        if cache is not None:  # (a paged view's gather, never its fused kernel)
            k, v = cache.write(i, k, v)
        if packing is not None:
            out = torch.cat([attn_sinks.attend(q[:, :, qs], k[:, :, ks], v[:, :, ks], scale,
                                               sinks, sliding_window.visible(qp, kp, window))
                             for qs, ks, qp, kp in _segments(packing, q.device)], dim=2)
        else:
            if mask is not None:  # the sampler's causal mask [B, 1, S, L]
                seen = sliding_window.narrow(mask if mask.dtype == torch.bool else mask == 0,
                                             window)
            else:  # a row's queries are its last S positions
                L = k.shape[2]
                keys = torch.arange(L, device=q.device)
                seen = sliding_window.visible(keys[L - S:], keys, window)
            out = attn_sinks.attend(q, k, v, scale, sinks, seen)
        return out.transpose(1, 2).reshape(B, S, -1)


def _segments(packing, device):
    """(query slice, key slice, query positions, key positions) of each sequence of a packed
    pass: training's Packing (keys = queries, positions from 0) or the sampler's prefill
    pieces (queries start..end over keys 0..end)."""
    if hasattr(packing, "starts"):  # prefill.py's pieces
        lens = zip(packing.q_lens, packing.k_lens, packing.starts, strict=True)
    elif isinstance(packing, Packing):
        lens = ((n, n, 0) for n in packing.lengths)
    else:
        raise EngineInputError("model", f"gpt-oss attention does not take "
                               f"{type(packing).__name__} (shared-prefix or context-parallel "
                               "packing) yet")
    qa = ka = 0
    for n, L, s in lens:
        yield (slice(qa, qa + n), slice(ka, ka + L), torch.arange(s, s + n, device=device),
               torch.arange(L, device=device))
        qa, ka = qa + n, ka + L
