"""Qwen3.5 (dense): hybrid layers, three Gated DeltaNet (linear attention) of every four.

The checkpoint is Qwen3_5ForConditionalGeneration (config `qwen3_5`, the text model's
config nested as `text_config`, weights under model.language_model.*); transformers loads
its text part as Qwen3_5ForCausalLM (or, with the image processor's files, the whole model,
its vision tower kept beside: vision.py) and we run the layers here, BaseModel (model.py)
calling `HybridLayers.layer` for each.

What differs from the Llama family:
- Norms are zero-centred (x * (1 + w)), so they run as HF's modules, never fused_ops'.
- Full attention: q_proj yields each head's query and an output gate (o * sigmoid(gate)
  before o_proj); q/k norms; rotary on the first quarter of each head (partial rotary).
- Linear attention (linear_attn.py): in_proj_qkv -> causal conv -> q, k, v; in_proj_b ->
  beta; in_proj_a -> the decay g; in_proj_z gates the gated RMS norm before out_proj.
LoRA targets (the tinker client's train_attn): q/k/v/o_proj on full-attention layers and
in_proj_qkv, in_proj_z, in_proj_b, in_proj_a and out_proj on linear ones; train_mlp:
gate/up/down_proj of every layer; train_unembed: lm_head.

Qwen3.5-MoE and Qwen3-Next run these layers with a sparse MLP (qwen35_moe.py); Qwen3-Next's
linear attention fuses its input projections (in_proj_qkvz, in_proj_ba: `projections`).

Sequences never share state: packed rows (training's Packing, the sampler's prefill
pieces) are cut into independent rows for the conv and the delta rule. The sampler's
state lives in `cache.recurrent` (recurrent.py): per prefill piece or per decode slot.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from twinkled.protocol.types import ATTN_MODULES, LINEAR_ATTN_MODULES

from . import linear_attn as la
from . import qwen35_moe
from .fused_ops import rotate

log = logging.getLogger(__name__)


# Dense, and Qwen3.5-MoE's (qwen35_moe.py: the same layers with a sparse MLP).
ARCHS = ("qwen3_5", "qwen3_5_text", *qwen35_moe.ARCHS)


def text_config(config):
    """The text model's config of a Qwen3.5 checkpoint (nested under text_config)."""
    return config.get_text_config() if config.model_type in ("qwen3_5", "qwen3_5_moe") else config


def trim_targets(config, targets: dict) -> None:
    """Take out the linears a peft adapter of this model cannot hold (qwen35_moe.py)."""
    for key in qwen35_moe.untargetable(config.model_type, targets):
        del targets[key]


def layer_keys(i: int, layer) -> dict[str, str]:
    """Layer i's LoRA targets of the attention kind it has (and a sparse MLP's shared
    expert's); BaseModel adds a dense MLP's."""
    if hasattr(layer, "linear_attn"):  # (Qwen3.5's four input projections, or Qwen3-Next's two)
        keys = {n: f"model.layers.{i}.linear_attn.{n}" for n in LINEAR_ATTN_MODULES
                if hasattr(layer.linear_attn, n)}
    else:
        keys = {n: f"model.layers.{i}.self_attn.{n}" for n in ATTN_MODULES}
    return keys | qwen35_moe.shared_keys(i, layer)


class HybridLayers:
    """The Qwen3.5 decoder layer over BaseModel's linears (LoRA) and attention."""

    def __init__(self, model):
        self.model = model
        self.linear = [i for i, layer in enumerate(model.layers) if hasattr(layer, "linear_attn")]
        # Only full-attention layers hold KV: layer i's in the sampler's pages is kv[i].
        full = [i for i in range(len(model.layers)) if i not in self.linear]
        self.kv = {i: j for j, i in enumerate(full)}
        # fla-core's chunked kernel where it runs (CUDA, installed); False: the torch
        # delta rule everywhere (the reference tests/test_qwen35_gpu.py compares it with).
        self.fla = True

    def warm(self) -> bool:
        """Run fla-core's kernels once on the model's own head sizes, so that their Triton
        autotuning (every config of every kernel compiled and timed: ~40 s on an H200 for
        one set of head sizes) happens while the model loads, before the daemon answers
        healthz, and not in the first sample or training step a tenant sends. False where
        fla does not run (a CPU, no fla-core)."""
        try:
            return self._warm()
        except Exception:  # an optimisation: the model still loads, and says why
            log.exception("warming fla-core's kernels failed; they autotune on first use")
            return False

    def _warm(self) -> bool:
        m = self.model
        if not self.linear or not self.fla:
            return False
        mod = m.layers[self.linear[0]].linear_attn
        x = torch.zeros(1, 1, device=m.device, dtype=m.dtype)
        if not la.fla_usable(x):
            return False
        gen = torch.Generator(device=m.device).manual_seed(0)
        L, hk, hv = 64, mod.num_k_heads, mod.num_v_heads
        train = la.fla_usable(x, backward=True)
        for n in (L, 1):  # a prefill (varlen chunks) and a decode step (fused recurrent)
            q, k = (torch.randn(1, n, hk, mod.head_k_dim, device=m.device, dtype=m.dtype,
                                generator=gen) for _ in range(2))
            v = torch.randn(1, n, hv, mod.head_v_dim, device=m.device, dtype=m.dtype,
                            generator=gen)
            g = -torch.rand(1, n, hv, device=m.device, generator=gen)
            beta = torch.rand(1, n, hv, device=m.device, generator=gen)
            if n > 1 and train:  # the training step's backward kernels too, where fla's is used
                with torch.enable_grad():
                    for t in (q, k, v):
                        t.requires_grad_(True)
                    o, _ = la.fla_rule(q, k, v, g, beta, None, [n])
                    o.float().sum().backward()
            with torch.no_grad():
                if n > 1:
                    la.fla_rule(q.detach(), k.detach(), v.detach(), g, beta, None, [n])
                else:  # (a decode step carries its sequence's state, as here)
                    state = torch.zeros(1, hv, mod.head_k_dim, mod.head_v_dim,
                                        device=m.device)
                    la.fla_step(q, k, v, g, beta, state)
        torch.cuda.synchronize(m.device)
        return True

    def layer(self, i, layer, h, cos, sin, lora, cache, mask, packing, banks) -> torch.Tensor:
        m, keys = self.model, self.model.layer_keys[i]
        x = m.tp.enter(layer.input_layernorm(h))  # (tensor parallelism: tp.py, tp_linear.py)
        if i in self.linear:
            a = self._linear_attention(i, layer.linear_attn, x, keys, lora, cache, packing)
        else:
            a = self._attention(i, layer.self_attn, x, cos, sin, keys, lora, cache, mask, packing)
        h = h + m.tp.leave(a)
        x = layer.post_attention_layernorm(h)
        if i in m.moe:  # Qwen3.5-MoE (`banks`: the tokens each bank's adapters own, moe.py)
            return h + qwen35_moe.sparse_mlp(m, i, layer.mlp, x, keys, lora, banks)
        return h + m.mlp(i, layer.mlp, x, keys, lora)

    def _attention(self, i, attn, x, cos, sin, keys, lora, cache, mask, packing):
        m = self.model
        B, S, _ = x.shape
        (qg, k, v), _ = m.linears((attn.q_proj, attn.k_proj, attn.v_proj),
                                   (keys["q_proj"], keys["k_proj"], keys["v_proj"]), x, lora)
        q, gate = qg.view(B, S, -1, 2 * m.head_dim).chunk(2, dim=-1)
        q = attn.q_norm(q).transpose(1, 2)
        k = attn.k_norm(k.view(B, S, -1, m.head_dim)).transpose(1, 2)
        v = v.view(B, S, -1, m.head_dim).transpose(1, 2)
        r = cos.shape[-1]  # partial rotary: the first r dims of each head
        q = torch.cat([rotate(q[..., :r], cos, sin), q[..., r:]], dim=-1)
        k = torch.cat([rotate(k[..., :r], cos, sin), k[..., r:]], dim=-1)
        out = m.attend(self.kv[i], q, k, v, cache, mask, packing)
        out = out * torch.sigmoid(gate.reshape(B, S, -1))
        return m.linear(attn.o_proj, keys["o_proj"], out, lora)

    def projections(self, mod, x, keys, lora) -> list[torch.Tensor]:
        """A linear-attention layer's inputs [B, S, ...]: qkv (all q heads, then k, then v, as
        the conv reads them), z, b and a, each with its LoRA. Qwen3-Next fuses them in two
        linears whose outputs are grouped by key head (q, k, v, z of each group; b, a of each
        group): regrouped here after the LoRA deltas, so its adapters are peft's on its
        modules."""
        names = ("in_proj_qkvz", "in_proj_ba") if hasattr(mod, "in_proj_qkvz") else (
            "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        ys, _ = self.model.linears([getattr(mod, n) for n in names], [keys[n] for n in names],
                                   x, lora)
        if len(ys) == 4:
            return ys
        B, S, _ = x.shape
        nk, dk, dv = mod.num_k_heads, mod.head_k_dim, mod.head_v_dim
        per = mod.num_v_heads // nk
        q, k, v, z = ys[0].view(B, S, nk, -1).split([dk, dk, per * dv, per * dv], dim=-1)
        b, a = ys[1].view(B, S, nk, -1).split([per, per], dim=-1)
        qkv = torch.cat([t.reshape(B, S, -1) for t in (q, k, v)], dim=-1)
        return [qkv, z.reshape(B, S, -1), b.reshape(B, S, -1), a.reshape(B, S, -1)]

    def _linear_attention(self, i, mod, x, keys, lora, cache, packing):
        m = self.model
        B, S, _ = x.shape
        qkv, z, b, a = self.projections(mod, x, keys, lora)
        states = getattr(cache, "recurrent", None)
        if cache is not None and states is None:
            raise RuntimeError("linear attention samples only through the running batch")
        if packing is not None:  # independent sequences end to end: one row each
            lengths = list(packing.lengths)
            qkv, b, a = (la.to_rows(t, lengths) for t in (qkv, b, a))
        else:
            lengths = [S] * B
        conv0, ssm0 = states.initial(i) if states is not None else (None, None)
        y, conv1 = la.causal_conv(qkv, mod.conv1d.weight[:, 0], conv0, lengths)
        N, L, _ = y.shape
        q, k, v = torch.split(y, [mod.key_dim, mod.key_dim, mod.value_dim], dim=-1)
        q, k = (t.reshape(N, L, -1, mod.head_k_dim) for t in (q, k))
        v = v.reshape(N, L, -1, mod.head_v_dim)
        beta = b.float().sigmoid()
        g = -mod.A_log.float().exp() * F.softplus(a.float() + mod.dt_bias.float())
        if any(n < L for n in lengths):  # padded positions neither decay nor write the state
            real = la.valid(lengths, L, x.device)[..., None]
            beta, g = beta * real, g * real
        if self.fla and la.fla_usable(x, backward=torch.is_grad_enabled()):  # Triton (CUDA)
            if L == 1:
                o, ssm1 = la.fla_step(q, k, v, g, beta, ssm0)
            else:
                o, ssm1 = la.fla_rule(q, k, v, g, beta, ssm0, lengths)
        else:
            rep = mod.num_v_heads // mod.num_k_heads
            q, k = (la.l2norm(t.float().repeat_interleave(rep, dim=2)) for t in (q, k))
            q = q * mod.head_k_dim**-0.5
            rule = la.delta_step if L == 1 else la.delta_rule
            o, ssm1 = rule(q, k, v, g, beta, ssm0)
        if states is not None:
            states.keep(i, conv1, ssm1)
        if packing is not None:
            o = la.from_rows(o, lengths)
        o = mod.norm(o.reshape(-1, mod.head_v_dim).to(x.dtype), z.reshape(-1, mod.head_v_dim))
        return m.linear(mod.out_proj, keys["out_proj"], o.view(B, S, -1), lora)
