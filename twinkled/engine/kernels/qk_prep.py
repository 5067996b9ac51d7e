"""A decode step's new q, k and v made ready for the paged attention in one launch.

Why: on the sampler's decode path (one new token a row, a `PagedView` with `lengths`: the
paged kernel's) each decoder layer ran, before the attention kernel itself, q's and k's
per-head RMSNorm (two liger kernels; Qwen3), the rotation (liger's, which first copies the
non-contiguous views of the q/k/v GEMM's output) and two `index_copy_` kernels storing k and
v into the page pool: ~5-7 small kernels a layer, ~2,000 a step on a 36-layer 8B, whose
gaps cost ~1.5 ms of a ~17.5 ms step. `qk_prep` is all of that as one kernel.

What it computes, one program per (row, head) of q and of k (that one also copies v's head):
read the head in place by strides (any row and head strides, a unit last one: views of the
joint GEMM output need no copy); with `norms` (Qwen3's q_norm/k_norm; Qwen2/Llama have
none, a constexpr skips it) RMSNorm it; rotate it with the row's cos/sin (the half-split
layout of fused_ops.rotate); write q's to a fresh [B, Hq, D] (what paged_decode takes) and
k's, and v's head as it is, to the layer's pool at the row's slot (PagedView.write_slots).
Nothing else in the pool is touched.

Rounding: the CUDA reference's steps (liger's kernels), in fp32 math rounded to the model
dtype where they round. The norm as liger's RMSNorm in "llama" casting mode (and
fused_ops.rms_norm's eager path): the mean square and rsqrt in fp32, x * rstd rounded to the
dtype, times the weight (an exact product of two dtype values in fp32) rounded again. The
rotation as liger's rope compiles for sm_90 (its PTX, Triton 3.9: mul.bf16, then fma.rn.bf16):
y1 = round(x1 * cos - round(x2 * sin)), y2 = round(x1 * sin + round(x2 * cos)).
fused_ops.rotate (the eager path, CPU) rounds both products, so there an element may differ
by one ulp. In fp32 the roundings are no-ops. What may differ from liger by an ulp, rarely:
the mean square's summation order and rsqrt's last bit (a value rounded after it then lands
on the other side of a tie).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# One warp a program: a head's half is D / 2 = 64 values on the 8B, two a thread.
NUM_WARPS = 1


@triton.jit
def _rounded(x, DT: tl.constexpr):
    """x (fp32) rounded to the model dtype, back in fp32: where the reference rounds. bf16 by
    its bits, to nearest even as the GPU's conversion rounds: Triton's interpreter (the CPU
    tests) truncates in `.to(tl.bfloat16)`, and this gives the same bits in both."""
    if DT == tl.float32:
        return x
    elif DT == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + (0x7FFF + ((b >> 16) & 1))) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True)
    else:
        return x.to(DT).to(tl.float32)


@triton.jit
def _norm_rotate(x_ptr, s_d, w_ptr, eps, c1, s1, c2, s2, offs, m, HALF: tl.constexpr,
                 NORM: tl.constexpr, DT: tl.constexpr):
    """One head's two halves, normed (NORM) and rotated: fp32 holding values of the dtype
    (so the stores' conversions are exact)."""
    x1 = tl.load(x_ptr + offs * s_d, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + (offs + HALF) * s_d, mask=m, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / (2 * HALF) + eps)
        w1 = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs, mask=m, other=0.0).to(tl.float32)
        x1 = _rounded(_rounded(x1 * rstd, DT) * w1, DT)
        x2 = _rounded(_rounded(x2 * rstd, DT) * w2, DT)
    # liger's rope as it compiles for sm_90: one product rounded, the other fused into the
    # sum (fma.rn.bf16). The fused product of two dtype values is exact in fp32 here, so
    # the one rounding after the sum is the fma's (bar a sum that fp32 itself must round).
    y1 = _rounded(x1 * c1 - _rounded(x2 * s1, DT), DT)
    y2 = _rounded(x1 * s2 + _rounded(x2 * c2, DT), DT)
    return y1, y2


@triton.jit
def _qk_prep(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, slot_ptr, out_ptr,
             kp_ptr, vp_ptr, sq_b, sq_h, sq_d, sk_b, sk_h, sk_d, sv_b, sv_h, sv_d, sc_b, ss_b,
             so_b, so_h, skp_t, skp_h, svp_t, svp_h, q_eps, k_eps,
             HQ: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
             NORM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    DT = out_ptr.dtype.element_ty
    offs = tl.arange(0, HALF_PAD)
    m = offs < HALF
    c1 = tl.load(cos_ptr + row * sc_b + offs, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + row * sc_b + HALF + offs, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + row * ss_b + offs, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + row * ss_b + HALF + offs, mask=m, other=0.0).to(tl.float32)
    if head < HQ:
        y1, y2 = _norm_rotate(q_ptr + row * sq_b + head * sq_h, sq_d, qw_ptr, q_eps,
                              c1, s1, c2, s2, offs, m, HALF, NORM, DT)
        out = out_ptr + row * so_b + head * so_h
        tl.store(out + offs, y1.to(DT), mask=m)
        tl.store(out + HALF + offs, y2.to(DT), mask=m)
    else:
        kv = head - HQ
        slot = tl.load(slot_ptr + row).to(tl.int64)  # (slots * Hkv * D passes 2^31)
        y1, y2 = _norm_rotate(k_ptr + row * sk_b + kv * sk_h, sk_d, kw_ptr, k_eps,
                              c1, s1, c2, s2, offs, m, HALF, NORM, DT)
        dst = kp_ptr + slot * skp_t + kv * skp_h
        tl.store(dst + offs, y1.to(DT), mask=m)
        tl.store(dst + HALF + offs, y2.to(DT), mask=m)
        src = v_ptr + row * sv_b + kv * sv_h
        dst = vp_ptr + slot * svp_t + kv * svp_h
        for part in tl.static_range(2):
            v = tl.load(src + (part * HALF + offs) * sv_d, mask=m, other=0.0)
            tl.store(dst + part * HALF + offs, v, mask=m)


def qk_prep(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor, norms: tuple[torch.Tensor, torch.Tensor, float, float] | None,
            keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """q [B, 1, Hq, D], k and v [B, 1, Hkv, D] of the new token, any strides (views of the
    q/k/v GEMM's output): q and k normed by `norms` (q's weight, k's weight, q's eps, k's eps;
    None: no norm) and rotated by cos/sin [B or 1, 1, D]; k and v stored into one layer's
    pool `keys`/`values` [slots, Hkv, D] (unit last stride) at `slots` [B]. Returns the
    rotated q [B, Hq, D], contiguous, in q's dtype."""
    B, _, Hq, D = q.shape
    Hkv = k.shape[2]
    if D % 2 or keys.stride(2) != 1 or values.stride(2) != 1:
        raise ValueError("qk_prep needs an even head dim and pools of unit last stride")
    if cos.stride(-1) != 1 or sin.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((B, Hq, D), dtype=q.dtype, device=q.device)
    # (a weight unused without norms: any pointer does)
    q_w, k_w, q_eps, k_eps = norms if norms is not None else (cos, cos, 0.0, 0.0)
    _qk_prep[(B, Hq + Hkv)](
        q, k, v, cos, sin, q_w, k_w, slots, out, keys, values,
        q.stride(0), q.stride(2), q.stride(3), k.stride(0), k.stride(2), k.stride(3),
        v.stride(0), v.stride(2), v.stride(3),
        cos.stride(0) if cos.shape[0] > 1 else 0, sin.stride(0) if sin.shape[0] > 1 else 0,
        out.stride(0), out.stride(1), keys.stride(0), keys.stride(1), values.stride(0),
        values.stride(1), float(q_eps), float(k_eps),
        HQ=Hq, HALF=D // 2, HALF_PAD=triton.next_power_of_2(D // 2), NORM=norms is not None,
        num_warps=NUM_WARPS)
    return out
