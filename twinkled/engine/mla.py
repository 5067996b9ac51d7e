"""Multi-head latent attention (MLA): DeepSeek-V3's (and Kimi-K2's) attention.

Per layer (transformers' DeepseekV3Attention holds the weights; we run the math so every
linear carries its LoRA deltas):
- query: q_a_proj -> q_a_layernorm -> q_b_proj (or one q_proj where q_lora_rank is None),
  each head split into a no-position part (qk_nope_head_dim) and a rotary part
  (qk_rope_head_dim);
- keys/values: kv_a_proj_with_mqa -> [latent (kv_lora_rank) | one shared rotary key
  (qk_rope_head_dim)]; the latent -> kv_a_layernorm -> kv_b_proj -> each head's no-position
  key and its value (v_head_dim); the shared rotary key is every head's rotary part;
- rotary: DeepSeek's weights pair dims interleaved (x0, x1), (x2, x3)... when the config
  says `rope_interleave` (the released checkpoints), else as the Llama family (halves);
- softmax scale: qk_head_dim**-0.5 times YaRN's mscale squared where the rope is scaled
  (transformers computes it on the module as `scaling`; BaseModel takes it from there).

Cache: the samplers keep the LATENT, per token and layer the normed latent and the rotated
shared key (kv_lora_rank + qk_rope_head_dim, one "head": 576 values on the real model
against 2 * 128 * 192 expanded): the running batch's KV pages (`kv_shape`, a latent
PagePool with zero-wide values) and the padded sampler's cache (`new_cache`). The running
batch's decode attends over the latents themselves, kv_b_proj absorbed into the queries
and the output, each row's LoRA of it in pieces (`_absorbed`: O(rank) work a cached token).
A prefill, and the padded sampler, expand a row's cached latents through kv_b_proj (its
LoRA in; a packed prefill's keys read back take their own piece's LoRA, `key_lora`) and
attend in torch (O(context x heads x rank) a step), never the fused paged decode. Where no
latent cache is given (packed training), keys and values are expanded per head, the values zero-padded to the
key width (qk_head_dim) so packed rows and the flash kernels take them unchanged; the
output's padded columns are dropped.

Tensor parallelism (tp.py) splits the heads: each rank expands the whole latent through its
heads' rows of kv_b_proj, so the cache, and the down-projections that make it, are whole
on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from twinkled.protocol.types import MLA_MODULES

from .fused_ops import rotate
from .kv_cache import KVCache

ARCHS = ("deepseek_v3", "kimi_k2")
# The most values one decode attention call expands keys into (LatentAttention._decode):
# well under 2**31, what SDPA's CUDA kernels index safely.
SDPA_ELEMENTS = 2**30
# The linears of an MLA layer a LoRA may target (peft names; q_proj where q_lora_rank is None).
LINEARS = ("q_proj", *MLA_MODULES, "o_proj")


def layer_keys(i: int, attn) -> dict[str, str]:
    """The LoRA keys of layer i's attention linears that exist (q_proj or q_a/q_b)."""
    return {n: f"model.layers.{i}.self_attn.{n}" for n in LINEARS
            if getattr(attn, n, None) is not None}


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary over interleaved pairs (x0, x1), (x2, x3)...; the output lays the pairs out
    as halves (evens then odds), as transformers does for DeepSeek: q and k both, so their
    dot products are those of the interleaved rotation."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half].unsqueeze(1), sin[..., :half].unsqueeze(1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class LatentAttention:
    """MLA over BaseModel's linears (LoRA) and attention (caches, packed rows)."""

    def __init__(self, model):
        c = model.config
        self.model = model
        self.nope, self.rope = c.qk_nope_head_dim, c.qk_rope_head_dim
        self.v_dim, self.rank = c.v_head_dim, c.kv_lora_rank
        self.interleave = bool(getattr(c, "rope_interleave", True))
        # What the caches keep per token and layer: one "head" of [latent | rotated shared
        # key], no values (the running batch's pages as the padded sampler's cache).
        self.kv_shape = (1, self.rank + self.rope, 0)

    def attention(self, i, attn, x, cos, sin, keys, lora, cache, mask, packing) -> torch.Tensor:
        m = self.model
        B, S, _ = x.shape
        if attn.q_lora_rank is None:
            q = m.linear(attn.q_proj, keys["q_proj"], x, lora)
            ckv = m.linear(attn.kv_a_proj_with_mqa, keys["kv_a_proj_with_mqa"], x, lora)
        else:  # q_a and kv_a read the same x: one group (lora_fused.py)
            (qa, ckv), _ = m.linears((attn.q_a_proj, attn.kv_a_proj_with_mqa),
                                     (keys["q_a_proj"], keys["kv_a_proj_with_mqa"]), x, lora)
            q = m.linear(attn.q_b_proj, keys["q_b_proj"], attn.q_a_layernorm(qa), lora)
        q = q.view(B, S, -1, self.nope + self.rope).transpose(1, 2)
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
        latent, k_rot = ckv.split([self.rank, self.rope], dim=-1)
        latent = attn.kv_a_layernorm(latent)
        turn = rotate_interleaved if self.interleave else rotate
        q_rot, k_rot = turn(q_rot, cos, sin), turn(k_rot.view(B, 1, S, self.rope), cos, sin)
        q = torch.cat([q_nope, q_rot], dim=-1)
        H = q.shape[1]
        if getattr(cache, "latent", False):  # the sampler: store the latent, expand it all
            c, _ = cache.write(i, torch.cat([latent[:, None], k_rot], dim=-1), latent[:, None, :, :0])
            latent, k_rot = c[:, 0].split([self.rank, self.rope], dim=-1)
            # (a packed prefill's keys read back are laid out apart from its queries)
            kv_lora = lora if getattr(packing, "key_lora", None) is None else packing.key_lora
            if packing is None and self._absorbs(attn, kv_lora):  # the running batch's decode
                out = self._absorbed(attn, keys["kv_b_proj"], kv_lora, q, latent, k_rot, mask)
            elif packing is None:  # (the padded sampler's rows)
                out = self._decode(attn, keys, kv_lora, q, latent, k_rot, mask)
            else:  # the running batch's varlen prefill: each piece over its own keys
                k, v = self._expand(attn, keys, kv_lora, latent, k_rot[:, None])
                v = F.pad(v, (0, self.nope + self.rope - self.v_dim))
                out = packing.attend(q, k, v, m.scaling, False)[..., :self.v_dim]
            out = out.transpose(1, 2).reshape(B, S, -1)
            return m.linear(attn.o_proj, keys["o_proj"], out, lora)
        k, v = self._expand(attn, keys, lora, latent, k_rot)
        # Values padded to the key width: one cache shape (see the module's docstring).
        v = F.pad(v, (0, self.nope + self.rope - self.v_dim))
        out = m.attend(i, q, k, v, cache, mask, packing).view(B, S, H, -1)[..., :self.v_dim]
        return m.linear(attn.o_proj, keys["o_proj"], out.reshape(B, S, -1), lora)

    def _absorbs(self, attn, lora) -> bool:
        """Whether this pass attends over the latent itself (`_absorbed`): its LoRA gives
        its factors per row (the running batch's; a LoraBatch does not), and kv_b_proj has
        no bias (DeepSeek's has none)."""
        return attn.kv_b_proj.bias is None and (lora is None or hasattr(lora, "row_factors"))

    def _absorbed(self, attn, key, lora, q, latent, k_rot, mask) -> torch.Tensor:
        """Attention over the cached latents without expanding them (the matrix absorption
        of DeepSeek-V2's paper): head h's key is W_k[h] c + s B_k[h] (A c) and its value
        W_v[h] c + s B_v[h] (A c), so q . k = (W_k[h]^T q) . c + (B_k[h]^T q) . (s A c) and
        the output is W_v[h] (sum p c) + B_v[h] (sum p s A c). Every head then reads the same
        keys [c | s A c | rotated key] (s A c is zero outside the row's adapter's columns),
        one "head" of keys for H x S queries: O(rank) a cached token a step, where expanding
        it costs H x (nope + v) x rank. q [B, H, S, nope + rope], latent [B, L, rank],
        k_rot [B, L, rope] -> [B, H, S, v]."""
        B, H, S, _ = q.shape
        w = attn.kv_b_proj.weight.view(H, self.nope + self.v_dim, self.rank)
        w_k, w_v = w.split([self.nope, self.v_dim], dim=1)
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
        qs, ks = [torch.einsum("bhsn,hnr->bhsr", q_nope, w_k)], [latent]
        factors = None if lora is None else lora.row_factors(key)
        if factors is not None:  # A [width, rank], B [H (nope + v), width], mask [B, width]
            a_w, b_w, row_cols = factors
            b_k, b_v = b_w.view(H, self.nope + self.v_dim, -1).split([self.nope, self.v_dim], 1)
            ks.append(F.linear(latent, a_w) * row_cols[:, None, :])  # s A c: the row's columns
            qs.append(torch.einsum("bhsn,hnw->bhsw", q_nope, b_k))
        values = torch.cat(ks, dim=-1)[:, None]  # [B, 1, L, rank (+ width)]
        shared = torch.cat([*ks, k_rot], dim=-1)[:, None]  # every head's keys
        # the H x S queries as one head's (h-major), the mask's rows repeated to match
        queries = torch.cat([*qs, q_rot], dim=-1).reshape(B, 1, H * S, -1)
        if mask is not None and mask.shape[2] > 1:
            mask = mask.repeat(1, 1, H, 1)
        o = F.scaled_dot_product_attention(queries, shared, values, attn_mask=mask,
                                           scale=self.model.scaling).view(B, H, S, -1)
        out = torch.einsum("bhsr,hvr->bhsv", o[..., :self.rank], w_v)
        if factors is not None:
            out = out + torch.einsum("bhsw,hvw->bhsv", o[..., self.rank:], b_v)
        return out

    def _decode(self, attn, keys, lora, q, latent, k_rot, mask) -> torch.Tensor:
        """Attention of q [B, H, S, nope + rope] over every row's cached latents [B, L,
        rank] and rotated shared keys [B, L, rope] -> [B, H, S, v], by blocks of rows and
        heads whose expanded keys stay under SDPA_ELEMENTS (a row's expansion is all its
        heads' keys over its whole context: 256 rows of 768 tokens on the real model are
        4.8e9 values, 9.7 GB in bf16, past what SDPA's CUDA kernels index with 32 bits)."""
        B, H, S, width = q.shape
        L = latent.shape[1]
        kv = self.model.linear(attn.kv_b_proj, keys["kv_b_proj"], latent, lora)
        kv = kv.view(B, L, H, self.nope + self.v_dim)
        rows = max(1, min(B, SDPA_ELEMENTS // (L * width)))
        heads = max(1, min(H, SDPA_ELEMENTS // (rows * L * width)))
        out = q.new_empty(B, H, S, self.v_dim)
        for r in range(0, B, rows):
            rs = slice(r, r + rows)
            m_r = mask if mask is None or mask.shape[0] == 1 else mask[rs]
            for h in range(0, H, heads):
                hs = slice(h, h + heads)
                part = kv[rs, :, hs].transpose(1, 2)  # [b, h, L, nope + v]
                k_nope, v = part.split([self.nope, self.v_dim], dim=-1)
                k_r = k_rot[rs, None].expand(-1, k_nope.shape[1], -1, -1)
                k = torch.cat([k_nope, k_r], dim=-1)
                out[rs, hs] = F.scaled_dot_product_attention(q[rs, hs], k, v, attn_mask=m_r,
                                                             scale=self.model.scaling)
        return out

    def _expand(self, attn, keys, lora, latent, k_rot) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head's keys [B, H, L, nope + rope] and values [B, H, L, v] from the normed
        latents [B, L, rank] and the rotated shared keys [B, 1, L, rope]."""
        B, L, _ = latent.shape
        kv = self.model.linear(attn.kv_b_proj, keys["kv_b_proj"], latent, lora)
        kv = kv.view(B, L, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        H = k_nope.shape[1]
        return torch.cat([k_nope, k_rot.expand(B, H, L, self.rope)], dim=-1), v

    def new_cache(self, batch: int, max_len: int):
        """The padded sampler's latent cache: a KVCache whose `k` [layers, batch, 1,
        max_len, kv_lora_rank + qk_rope_head_dim] holds each token's normed latent and
        rotated shared key; its `v` is zero-wide (copied and indexed as KVCache's are, it
        holds nothing)."""
        m = self.model
        cache = KVCache(len(m.layers), batch, 1, max_len, 0, m.dtype, m.device)
        cache.k = torch.zeros((len(m.layers), batch, 1, max_len, self.rank + self.rope),
                              dtype=m.dtype, device=m.device)
        cache.latent = True
        return cache


def kimi_config(model_dir):
    """Kimi-K2's config (model_type kimi_k2, DeepSeek-V3's architecture, which transformers
    does not name) as a DeepseekV3Config; None for any other checkpoint."""
    import json
    from pathlib import Path

    path = Path(model_dir) / "config.json"
    if not path.is_file() or json.loads(path.read_text()).get("model_type") != "kimi_k2":
        return None
    from transformers import DeepseekV3Config

    raw = json.loads(path.read_text())
    raw.pop("auto_map", None)  # its remote code: never run
    return DeepseekV3Config(**{k: v for k, v in raw.items() if k != "model_type"})
