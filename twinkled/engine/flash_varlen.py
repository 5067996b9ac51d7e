"""Packed training attention through flash attention's own varlen ops: GQA without repeating
k/v heads, and shared prefixes read in place (cascade), forward and backward.

`torch.nn.attention.varlen.varlen_attn` takes the cuDNN backend where it can, and cuDNN wants
as many kv heads as query heads: on the GPU machines' torch the packed path repeated each
layer's keys and values 4x (Qwen3-8B: 32 query, 8 kv heads) before the kernel and summed the
gradients back after it. A continuation of a shared prefix (shared_prefix.py) also needed its
keys end to end, so the prefix's keys and values were gathered once per continuation: an 8B
RL group of 16 rollouts of 511 + 256 tokens held 2.8x its keys, which tipped whole steps
into recomputing their layers.

Here every packed pass is at most two calls of `aten._flash_attention_forward` (which takes
fewer kv heads than query heads as they are) over the packed q, k, v, with no copy:
  own:    every segment against its own keys, causal (a row alone, a shared segment, each
          continuation's own part);
  prefix: every run of continuations of one shared segment against that segment's keys, in
          full (no mask: a continuation sees its whole prefix). Varlen calls partition q and
          k into consecutive segments, so the stretch between two runs (the next shared
          segment, rows alone) is a filler segment whose result is discarded, and so are
          the results of the queries before the first run (they join its segment: a
          segment without keys gave wrong gradients on the GPU).
The two partial results merge by their log-sum-exps (a continuation's softmax over prefix and
own keys together). The backward runs flash's backward once per call with the merged output
and log-sum-exp, as attention split over keys allows (each call's dq, dk, dv are that part's
share of the whole; dq's add up). Filler tokens get no gradient (their dout is zero and their
log-sum-exp infinite in the prefix call).

`FLASH` is the GPU's pair of kernels; the tests run the same merge and backward on CPU with
`REFERENCE`, explicit math with flash's semantics, against SDPA with masks and autograd.
`ENABLED = False` keeps the path before (varlen_attn, repeated heads, gathered keys).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

ENABLED = True


@dataclass(frozen=True)
class Pass:
    """One varlen call: consecutive segments of q and of k (device int32 offsets)."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    causal: bool


@dataclass(frozen=True)
class Plan:
    own: Pass
    prefix: Pass | None = None  # continuations against their shared segments
    covered: torch.Tensor | None = None  # [T] bool: tokens that read a prefix
    shared: torch.Tensor | None = None  # [T] bool: tokens that are some prefix

    @staticmethod
    def of(spans: list[tuple[int, int]], prefixes: list[tuple[int, int] | None] | None,
           device) -> Plan:
        """`spans`: (start, length) of each segment in packed order, end to end; `prefixes`:
        the (start, length) of the shared segment each continues, or None."""
        starts = np.array([s for s, _ in spans] + [sum(spans[-1])], dtype=np.int64)
        lens = np.diff(starts)
        cu = torch.from_numpy(starts.astype(np.int32)).to(device)
        own = Pass(cu, cu, int(lens.max()), int(lens.max()), True)
        if not prefixes or all(p is None for p in prefixes):
            return Plan(own)
        # Runs of consecutive continuations of one prefix: (q start, q end, k start, k end).
        runs: list[list[int]] = []
        for (start, n), p in zip(spans, prefixes, strict=True):
            if p is None:
                continue
            if runs and runs[-1][1] == start and runs[-1][2:] == [p[0], p[0] + p[1]]:
                runs[-1][1] = start + n
            else:
                runs.append([start, start + n, p[0], p[0] + p[1]])
        cu_q, cu_k, q_at, k_at = [0], [0], 0, 0
        for q0, q1, k0, k1 in runs:  # a filler before each run, then the run
            if q0 < q_at or k0 < k_at or k1 > q0:
                raise ValueError("shared segments must precede their continuations in order")
            if k0 > k_at:  # a filler has keys: a keyless segment fails flash's backward
                cu_q.append(q0)
                cu_k.append(k0)
            cu_q.append(q1)  # (else the run's segment takes the queries before it too)
            cu_k.append(k1)
            q_at, k_at = q1, k1
        qn, kn = np.diff(cu_q), np.diff(cu_k)
        covered, shared = (np.zeros(int(starts[-1]), dtype=bool) for _ in range(2))
        for q0, q1, k0, k1 in runs:
            covered[q0:q1] = shared[k0:k1] = True
        prefix = Pass(*(torch.tensor(c, dtype=torch.int32, device=device) for c in (cu_q, cu_k)),
                      int(qn.max()), int(kn.max()), False)
        return Plan(own, prefix, *(torch.from_numpy(m).to(device) for m in (covered, shared)))


def available(q: torch.Tensor) -> bool:
    """Whether flash attention's varlen ops run these inputs."""
    return (ENABLED and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] <= 256 and hasattr(torch.ops.aten, "_flash_attention_forward"))


class _Flash:
    """flash attention's varlen forward and backward (aten ops, CUDA, half precision)."""

    @staticmethod
    def forward(q, k, v, p: Pass, scale: float):
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, p.cu_q, p.cu_k, p.max_q, p.max_k, 0.0, p.causal, False, scale=scale)
        return out, lse, (rng, unused)

    @staticmethod
    def backward(dout, q, k, v, out, lse, p: Pass, aux, scale: float):
        return torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse, p.cu_q, p.cu_k, p.max_q, p.max_k, 0.0, p.causal,
            *aux, scale=scale)


class _Reference:
    """The same semantics in plain torch, a segment at a time (tests, CPU): causal aligned
    to the end of a segment's keys, an empty key segment gives out 0 and lse +inf, tokens in
    no segment are left 0."""

    @staticmethod
    def _segments(p: Pass):
        cq, ck = p.cu_q.tolist(), p.cu_k.tolist()
        return zip(cq[:-1], cq[1:], ck[:-1], ck[1:], strict=True)

    @staticmethod
    def _wide(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.promote_types(t.dtype, torch.float32))

    @classmethod
    def _probs(cls, q, k, p: Pass, scale, q0, q1, k0, k1):
        g = q.shape[1] // k.shape[1]
        kk = cls._wide(k[k0:k1].repeat_interleave(g, dim=1))
        s = torch.einsum("qhd,khd->hqk", cls._wide(q[q0:q1]), kk) * scale
        if p.causal:
            nq, nk = q1 - q0, k1 - k0
            keep = torch.ones((nq, nk), dtype=torch.bool, device=q.device).tril(nk - nq)
            s = s.masked_fill(~keep, float("-inf"))
        return s

    @classmethod
    def forward(cls, q, k, v, p: Pass, scale: float):
        T, H, _ = q.shape
        g = H // k.shape[1]
        out = torch.zeros_like(q)
        lse = torch.full((H, T), float("inf"), device=q.device,
                         dtype=torch.promote_types(q.dtype, torch.float32))
        for q0, q1, k0, k1 in cls._segments(p):
            if q1 == q0 or k1 == k0:
                continue
            s = cls._probs(q, k, p, scale, q0, q1, k0, k1)
            lse[:, q0:q1] = torch.logsumexp(s, dim=-1)
            vv = cls._wide(v[k0:k1].repeat_interleave(g, dim=1))
            out[q0:q1] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vv).to(q.dtype)
        return out, lse, ()

    @classmethod
    def backward(cls, dout, q, k, v, out, lse, p: Pass, aux, scale: float):
        H, Hkv = q.shape[1], k.shape[1]
        g = H // Hkv
        dq, dk, dv = (torch.zeros_like(cls._wide(t)) for t in (q, k, v))
        for q0, q1, k0, k1 in cls._segments(p):
            if q1 == q0 or k1 == k0:
                continue
            s = cls._probs(q, k, p, scale, q0, q1, k0, k1)
            prob = torch.exp(s - lse[:, q0:q1, None])  # [H, q, k]
            do = cls._wide(dout[q0:q1])
            vv, kk = (cls._wide(t[k0:k1].repeat_interleave(g, dim=1)) for t in (v, k))
            dv_h = torch.einsum("hqk,qhd->khd", prob, do)
            dp = torch.einsum("qhd,khd->hqk", do, vv)
            delta = (do * cls._wide(out[q0:q1])).sum(-1).transpose(0, 1)[..., None]  # [H, q, 1]
            ds = prob * (dp - delta) * scale
            dq[q0:q1] += torch.einsum("hqk,khd->qhd", ds, kk)
            dk_h = torch.einsum("hqk,qhd->khd", ds, cls._wide(q[q0:q1]))
            dk[k0:k1] += dk_h.view(k1 - k0, Hkv, g, -1).sum(2)
            dv[k0:k1] += dv_h.view(k1 - k0, Hkv, g, -1).sum(2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


FLASH, REFERENCE = _Flash(), _Reference()


class _Cascade(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: Plan, scale: float, kernels):
        out, lse, aux_own = kernels.forward(q, k, v, plan.own, scale)
        aux_prefix = ()
        if plan.prefix is not None:
            out_p, lse_p, aux_prefix = kernels.forward(q, k, v, plan.prefix, scale)
            cov = plan.covered
            lse_p = torch.where(cov[None, :], lse_p, float("-inf"))
            merged = torch.logaddexp(lse_p, lse)
            w_p = torch.exp(lse_p - merged).transpose(0, 1)[..., None]
            w_o = torch.exp(lse - merged).transpose(0, 1)[..., None]
            out_p = torch.where(cov[:, None, None], out_p, 0)
            wide = torch.promote_types(q.dtype, torch.float32)
            out = (out_p.to(wide) * w_p + out.to(wide) * w_o).to(q.dtype)
            lse = merged
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale, ctx.kernels = plan, scale, kernels
        ctx.aux = (aux_own, aux_prefix)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plan, scale, kernels = ctx.plan, ctx.scale, ctx.kernels
        dout = dout.contiguous()
        dq, dk, dv = kernels.backward(dout, q, k, v, out, lse, plan.own, ctx.aux[0], scale)
        if plan.prefix is not None:
            cov = plan.covered
            # Filler tokens: no gradient in (dout 0), none out (infinite lse: p = 0).
            d_p = torch.where(cov[:, None, None], dout, 0).contiguous()
            lse_p = torch.where(cov[None, :], lse, float("inf")).contiguous()
            dq2, dk2, dv2 = kernels.backward(d_p, q, k, v, out, lse_p, plan.prefix,
                                             ctx.aux[1], scale)
            # Only covered queries and prefix keys are this call's: the kernel need not
            # write the rest (a filler without keys, keys after the last prefix).
            dq = dq + torch.where(cov[:, None, None], dq2, 0)
            dk, dv = (d + torch.where(plan.shared[:, None, None], d2, 0)
                      for d, d2 in ((dk, dk2), (dv, dv2)))
        return dq, dk, dv, None, None, None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan, scale: float,
           kernels=FLASH) -> torch.Tensor:
    """q [1, H, T, D], k/v [1, Hkv, T, D] -> [1, H, T, D]: each packed segment causal over its
    own keys, and a continuation over its whole shared prefix too."""
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))
    return _Cascade.apply(q, k, v, plan, scale, kernels).transpose(0, 1)[None]
