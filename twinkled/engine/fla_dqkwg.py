"""fla-core's `chunk_bwd_dqkwg` in torch, for Hopper under Triton >= 3.4, < 3.7.1.

fla-core's gated chunked backward is wrong there in one Triton kernel only (fla issue 640), and
fla raises rather than run it. Registered as a backend of fla's `common` dispatch (`register`),
this stands in for that one kernel; every other kernel of fla's backward stays Triton, so
Qwen3.5's linear attention trains with fla's rule instead of our slower torch chunk loop.

What the kernel differentiates, per chunk of BT positions (chunks never cross a sequence),
per value head, with G the in-chunk cumulative log decay (fla passes it in log2 units: G =
g ln 2), h the state at the chunk's start [K, V], v the delta rule's corrected values
(v_new = u - w h) and s the scale:

    o_t    = s exp(G_t) q_t h + s sum_{j<=t} exp(G_t - G_j) (q_t . k_j) v_j
    h_next = exp(G_last) h + sum_j exp(G_last - G_j) k_j^T v_j

Given do = dL/do, dh = dL/dh_next (fla's per-chunk dh), dv = dL/dv_new, it returns dq, dk
(these two paths only), dw = -dv h^T (through v_new = u - w h), and dg = dL/dG per position
(natural log units: fla's caller adds the WY part and reverse-cumsums it within the chunk).
All chunks at once: gathered into [chunks, heads, BT, ...] blocks, masked past a sequence's end.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def _chunks(B: int, T: int, BT: int, cu_seqlens: torch.Tensor | None,
            chunk_indices: torch.Tensor | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each chunk's first position in the flattened [B*T] tokens and its sequence's end, in
    fla's chunk order (the order of h and dh)."""
    if cu_seqlens is None:
        NT = -(-T // BT)
        b = torch.arange(B, device=device).repeat_interleave(NT)
        i = torch.arange(NT, device=device).repeat(B)
        return b * T + i * BT, (b + 1) * T
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    if chunk_indices is None:
        n = (cu[1:] - cu[:-1] + BT - 1) // BT
        seq = torch.arange(len(n), device=device).repeat_interleave(n)
        i = torch.arange(len(seq), device=device) - (n.cumsum(0) - n)[seq]
    else:
        seq, i = chunk_indices.to(device=device, dtype=torch.long).unbind(-1)
    return cu[seq] + i * BT, cu[seq + 1]


def chunk_bwd_dqkwg(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                    h: torch.Tensor, dh: torch.Tensor, w: torch.Tensor | None = None,
                    g: torch.Tensor | None = None, g_gamma: torch.Tensor | None = None,
                    dv: torch.Tensor | None = None, scale: float | None = None,
                    state_v_first: bool = False, cu_seqlens: torch.Tensor | None = None,
                    chunk_size: int = 64, chunk_indices: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fla's signature: q, k [B, T, H, K]; v, do, dv [B, T, HV, V]; w [B, T, HV, K];
    g [B, T, HV] fp32 (in-chunk cumulative, log2); h, dh [B, NT, HV, K, V] ([.., V, K] when
    state_v_first). Returns dq, dk [B, T, H, K] (q's, k's dtype; summed over each key head's
    value heads), dw (w's shape and dtype), dg [B, T, HV] fp32. Gated delta rule only: g
    and w given, g_gamma None (`verifier`)."""
    ok, why = verifier(q, k, v, do, h, dh, w, g, g_gamma, dv)
    if not ok:
        raise ValueError(why)
    B, T, H, K = k.shape
    HV = v.shape[2]
    BT = chunk_size
    scale = K**-0.5 if scale is None else scale
    dev = q.device
    start, end = _chunks(B, T, BT, cu_seqlens, chunk_indices, dev)
    pos = start[:, None] + torch.arange(BT, device=dev)  # [C, BT]
    real = pos < end[:, None]
    at = pos.clamp(max=B * T - 1)

    def block(x: torch.Tensor) -> torch.Tensor:
        """[B, T, heads, ...] -> fp32 [C, HV, BT, ...], zero past a sequence's end."""
        x = x.reshape(B * T, *x.shape[2:])
        if x.shape[1] != HV:  # a key head serves HV // H value heads (fla: i_h // (HV // H))
            x = x.repeat_interleave(HV // x.shape[1], dim=1)
        x = x[at].float()
        x = x * real.view(*real.shape, *[1] * (x.dim() - 2))
        return x.transpose(1, 2)

    qb, kb, vb, dob, dvb, Gb = (block(t) for t in (q, k, v, do, dv, g[..., None]))
    G = Gb[..., 0] * math.log(2)  # [C, HV, BT], natural log
    h, dh = (t.reshape(-1, HV, *t.shape[-2:]).float() for t in (h, dh))
    if state_v_first:
        h, dh = h.transpose(-1, -2), dh.transpose(-1, -2)  # -> [C, HV, K, V]
    last = (end - start).clamp(max=BT) - 1  # each chunk's last real position
    G_last = G.gather(-1, last[:, None, None].expand(-1, HV, 1))  # [C, HV, 1]
    keep = real[:, None, :, None]
    # the state's paths: o reads h decayed to t; h_next takes k_t decayed to the chunk's end
    dq = scale * (dob @ h.transpose(-1, -2)) * G.exp()[..., None]
    dk = (vb @ dh.transpose(-1, -2)) * (G_last - G).exp()[..., None] * keep
    dG_last = (h * dh).sum((-1, -2))[..., None] * G_last.exp() + (dk * kb).sum((-1, -2))[..., None]
    # within the chunk: o_t takes (q_t . k_j) v_j exp(G_t - G_j) for j <= t (masked before
    # the exp: no overflow above the diagonal)
    causal = torch.ones(BT, BT, dtype=torch.bool, device=dev).tril() & real[:, None, :, None] \
        & real[:, None, None, :]
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    ds = (dob @ vb.transpose(-1, -2)) * decay * scale
    dq = dq + ds @ kb
    dk = dk + ds.transpose(-1, -2) @ qb
    dG = (dq * qb).sum(-1) - (dk * kb).sum(-1)
    dG = dG.scatter_add(-1, last[:, None, None].expand(-1, HV, 1), dG_last)
    dw = -(dvb @ h.transpose(-1, -2))

    def unblock(x: torch.Tensor, like: torch.Tensor, heads: int) -> torch.Tensor:
        """The inverse of `block` (real positions only), summed back onto `heads` heads."""
        x = x.transpose(1, 2)[real]  # [positions, HV, ...] in chunk order
        if heads != HV:
            x = x.view(x.shape[0], heads, HV // heads, *x.shape[2:]).sum(2)
        out = torch.zeros(B * T, *x.shape[1:], dtype=x.dtype, device=dev)
        out[pos[real]] = x
        return out.view(*like.shape[:2], *x.shape[1:]).to(like.dtype)

    return (unblock(dq, q, H), unblock(dk, k, H), unblock(dw, w, HV),
            unblock(dG, g.float(), HV))


def verifier(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
             h: torch.Tensor, dh: torch.Tensor, w: torch.Tensor | None = None,
             g: torch.Tensor | None = None, g_gamma: torch.Tensor | None = None,
             dv: torch.Tensor | None = None, *args, **kwargs) -> tuple[bool, str | None]:
    """What the gated delta rule's backward passes; anything else stays fla's own kernel."""
    if g is None or w is None or dv is None:
        return False, "the torch dqkwg covers the gated delta rule only (g, w and dv given)"
    if g_gamma is not None:
        return False, "the torch dqkwg does not take g_gamma"
    if v.shape[2] % k.shape[2]:
        return False, f"value heads {v.shape[2]} not a multiple of key heads {k.shape[2]}"
    return True, None


def register(enabled: Callable[[], bool]) -> None:
    """Make fla's `common` dispatch route `chunk_bwd_dqkwg` here (registering again replaces,
    by backend type). Enabled while `enabled()` says so (linear_attn's TORCH_DQKWG), so the
    switch stays the one truth after registration; TileLang, where fla finds it usable, keeps
    precedence."""
    from fla.backends import BaseBackend
    from fla.backends import register as fla_register

    class TorchDqkwg(BaseBackend):
        backend_type = "twinkle_torch_dqkwg"
        priority = 6  # after fla's own backends (5)

        def is_enabled(self) -> bool:
            return enabled()

        def chunk_bwd_dqkwg_verifier(self, *args, **kwargs) -> tuple[bool, str | None]:
            return verifier(*args, **kwargs)

        def chunk_bwd_dqkwg(self, *args, **kwargs):
            return chunk_bwd_dqkwg(*args, **kwargs)

    fla_register("common")(TorchDqkwg)
