"""fla-core's `chunk_bwd_dqkwg` (and `chunk_bwd_dv_local`) in torch, for Hopper under
Triton >= 3.4, < 3.7.1.

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


class _Blocks:
    """Tokens [B, T, heads, ...] to fp32 chunk blocks [C, HV, BT, ...] in fla's chunk order
    (zero past a sequence's end) and back: the layout both kernels here compute in."""

    def __init__(self, B: int, T: int, HV: int, BT: int, cu_seqlens: torch.Tensor | None,
                 chunk_indices: torch.Tensor | None, dev):
        self.B, self.T, self.HV = B, T, HV
        self.start, self.end = _chunks(B, T, BT, cu_seqlens, chunk_indices, dev)
        self.pos = self.start[:, None] + torch.arange(BT, device=dev)  # [C, BT]
        self.real = self.pos < self.end[:, None]
        self._at = self.pos.clamp(max=B * T - 1)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(self.B * self.T, *x.shape[2:])
        if x.shape[1] != self.HV:  # a key head serves HV // H value heads (fla: i_h // (HV // H))
            x = x.repeat_interleave(self.HV // x.shape[1], dim=1)
        x = x[self._at].float()
        x = x * self.real.view(*self.real.shape, *[1] * (x.dim() - 2))
        return x.transpose(1, 2)

    def unblock(self, x: torch.Tensor, like: torch.Tensor, heads: int) -> torch.Tensor:
        """The inverse of `block` (real positions only), summed back onto `heads` heads."""
        x = x.transpose(1, 2)[self.real]  # [positions, HV, ...] in chunk order
        if heads != self.HV:
            x = x.view(x.shape[0], heads, self.HV // heads, *x.shape[2:]).sum(2)
        out = torch.zeros(self.B * self.T, *x.shape[1:], dtype=x.dtype, device=x.device)
        out[self.pos[self.real]] = x
        return out.view(*like.shape[:2], *x.shape[1:]).to(like.dtype)


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
    blocks = _Blocks(B, T, HV, BT, cu_seqlens, chunk_indices, dev)
    block, unblock, real = blocks.block, blocks.unblock, blocks.real
    start, end = blocks.start, blocks.end
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
    return (unblock(dq, q, H), unblock(dk, k, H), unblock(dw, w, HV),
            unblock(dG, g.float(), HV))


def chunk_bwd_dv_local(q: torch.Tensor, k: torch.Tensor, do: torch.Tensor,
                       g: torch.Tensor | None = None, g_gamma: torch.Tensor | None = None,
                       A: torch.Tensor | None = None, scale: float | None = None,
                       cu_seqlens: torch.Tensor | None = None, chunk_size: int = 64,
                       chunk_indices: torch.Tensor | None = None) -> torch.Tensor:
    """fla's `chunk_bwd_dv_local`, the kernel the gated backward runs just before
    `chunk_bwd_dqkwg`: dL/dv of the in-chunk part of o alone, dv_j = sum over t >= j in j's
    chunk of s exp(G_t - G_j) (q_t . k_j) do_t. q, k [B, T, H, K]; do [B, T, HV, V]; g
    [B, T, HV] (in-chunk cumulative, log2). Returns dv in do's shape and dtype. On an H200
    under Triton 3.6 fla's kernel faulted (an illegal address) on one of
    tests/test_qwen35_gpu.py's varlen batches, once its refused backward was let run."""
    ok, why = dv_local_verifier(q, k, do, g, g_gamma, A)
    if not ok:
        raise ValueError(why)
    B, T, H, K = k.shape
    HV = do.shape[2]
    scale = K**-0.5 if scale is None else scale
    blocks = _Blocks(B, T, HV, chunk_size, cu_seqlens, chunk_indices, q.device)
    real = blocks.real
    qb, kb, dob, Gb = (blocks.block(t) for t in (q, k, do, g[..., None]))
    G = Gb[..., 0] * math.log(2)  # [C, HV, BT], natural log
    # A[j, t] for key position j, query position t >= j, both real (masked before the exp)
    later = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu() \
        & real[:, None, :, None] & real[:, None, None, :]
    decay = (G[..., None, :] - G[..., :, None]).masked_fill(~later, float("-inf")).exp()
    A = (kb @ qb.transpose(-1, -2)) * decay * scale
    return blocks.unblock(A @ dob, do, HV)


def dv_local_verifier(q: torch.Tensor, k: torch.Tensor, do: torch.Tensor,
                      g: torch.Tensor | None = None, g_gamma: torch.Tensor | None = None,
                      A: torch.Tensor | None = None, *args, **kwargs
                      ) -> tuple[bool, str | None]:
    """The gated delta rule's call (g given, no A, no g_gamma); anything else stays fla's."""
    if g is None or g_gamma is not None or A is not None:
        return False, "the torch dv_local covers the gated call only (g given, no A, no g_gamma)"
    if do.shape[2] % k.shape[2]:
        return False, f"value heads {do.shape[2]} not a multiple of key heads {k.shape[2]}"
    return True, None


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
    """Make fla's `common` dispatch route `chunk_bwd_dqkwg` and `chunk_bwd_dv_local` here
    (registering again replaces, by backend type). Enabled while `enabled()` says so (linear_attn's TORCH_DQKWG), so the
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

        def chunk_bwd_dv_local_verifier(self, *args, **kwargs) -> tuple[bool, str | None]:
            return dv_local_verifier(*args, **kwargs)

        def chunk_bwd_dv_local(self, *args, **kwargs):
            return chunk_bwd_dv_local(*args, **kwargs)

    fla_register("common")(TorchDqkwg)
