"""engine/fla_dqkwg.py (fla-core's `chunk_bwd_dqkwg` in torch) against autograd of the forward
it differentiates, written out chunk by chunk from fla's forward conventions (chunk_fwd_o and
the chunked state recurrence): fixed-length rows with a partial last chunk, varlen sequences
(lengths not multiples of the chunk), grouped value heads, both state layouts. fp32, CPU."""

from __future__ import annotations

import math

import pytest
import torch

from twinkled.engine import fla_dqkwg


def _inputs(B, T, H=2, HV=4, K=8, V=6, NT=None, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)
    return dict(q=r(B, T, H, K), k=r(B, T, H, K) * 0.5, v=r(B, T, HV, V), w=r(B, T, HV, K),
                do=r(B, T, HV, V), dv=r(B, T, HV, V), h=r(B, NT, HV, K, V), dh=r(B, NT, HV, K, V),
                # log decay per token in [-0.5, 0]; cumulated within chunks below
                step=-torch.rand(B, T, HV, generator=gen, dtype=torch.float64) * 0.5)


def _reference(x, spans, BT, scale):
    """dL/d(q, k, w, G) by autograd, L = <o, do> + <h_next, dh> + <v_new, dv> over chunks
    (b, start, length) in fla's order, G the in-chunk cumulative natural-log decay:
        o_t    = s exp(G_t) q_t h + s sum_{j<=t} exp(G_t - G_j) (q_t . k_j) v_j
        h_next = exp(G_last) h + sum_j exp(G_last - G_j) k_j^T v_j
        v_new  = u - w h   (h held: its own gradient is fla's other kernels' business)."""
    HV, H = x["v"].shape[2], x["q"].shape[2]
    q, k, w = (x[n].clone().requires_grad_(True) for n in ("q", "k", "w"))
    G = torch.zeros_like(x["step"])
    for b, s, n in spans:
        G[b, s:s + n] = x["step"][b, s:s + n].cumsum(0)
    G.requires_grad_(True)
    loss = 0.0
    for c, (b, s, n) in enumerate(spans):
        sl = slice(s, s + n)
        qc, kc = (t[b, sl].repeat_interleave(HV // H, dim=1).transpose(0, 1) for t in (q, k))
        vc, doc, dvc, wc = (x[nm][b, sl].transpose(0, 1) if nm != "w" else w[b, sl].transpose(0, 1)
                            for nm in ("v", "do", "dv", "w"))
        Gc = G[b, sl].transpose(0, 1)  # [HV, n]
        h, dh = (x[nm].reshape(-1, *x[nm].shape[2:])[c] for nm in ("h", "dh"))  # [HV, K, V]
        later = torch.ones(n, n, dtype=torch.bool).triu(1)
        decay = (Gc[:, :, None] - Gc[:, None, :]).masked_fill(later, float("-inf")).exp()
        o = scale * (Gc.exp()[..., None] * (qc @ h) + ((qc @ kc.transpose(1, 2)) * decay) @ vc)
        h_next = Gc[:, -1:, None].exp() * h + (kc * (Gc[:, -1:] - Gc).exp()[..., None]
                                               ).transpose(1, 2) @ vc
        v_new = -(wc @ h)
        loss = loss + (o * doc).sum() + (h_next * dh).sum() + (v_new * dvc).sum()
    return torch.autograd.grad(loss, (q, k, w, G)), G.detach()


def _check(x, spans, BT, cu=None, state_v_first=False):
    scale = x["q"].shape[-1]**-0.5
    want, G = _reference(x, spans, BT, scale)
    f32 = {n: t.float() for n, t in x.items()}
    h, dh = f32["h"], f32["dh"]
    if cu is not None:
        h, dh = h.reshape(1, -1, *h.shape[2:]), dh.reshape(1, -1, *dh.shape[2:])
    if state_v_first:
        h, dh = h.transpose(-1, -2).contiguous(), dh.transpose(-1, -2).contiguous()
    got = fla_dqkwg.chunk_bwd_dqkwg(
        q=f32["q"], k=f32["k"], v=f32["v"], do=f32["do"], h=h, dh=dh, w=f32["w"],
        g=(G / math.log(2)).float(), dv=f32["dv"], scale=scale, state_v_first=state_v_first,
        cu_seqlens=cu, chunk_size=BT)
    assert got[0].dtype == got[1].dtype == got[2].dtype == torch.float32
    assert got[3].dtype == torch.float32 and got[3].shape == x["step"].shape
    assert got[0].shape == x["q"].shape and got[2].shape == x["w"].shape
    for name, a, b in zip(("dq", "dk", "dw", "dg"), got, want, strict=True):
        err = (a.double() - b).abs().max().item()
        assert err < 1e-5 * max(1.0, b.abs().max().item()), (name, err)


@pytest.mark.parametrize("state_v_first", [False, True])
def test_fixed_length_rows_with_a_partial_last_chunk(state_v_first):
    B, T, BT = 2, 40, 16
    NT = -(-T // BT)
    x = _inputs(B, T, NT=NT)
    spans = [(b, i * BT, min(BT, T - i * BT)) for b in range(B) for i in range(NT)]
    _check(x, spans, BT, state_v_first=state_v_first)


def test_varlen_chunks_never_cross_a_sequence():
    lengths, BT = [37, 200, 5, 64], 64
    spans = []
    s = 0
    for n in lengths:
        spans += [(0, s + i, min(BT, n - i)) for i in range(0, n, BT)]
        s += n
    x = _inputs(1, sum(lengths), NT=len(spans), K=16, V=8, seed=1)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    _check(x, spans, BT, cu=cu)


def _dv_local_reference(x, spans, scale):
    """dL/dv of the in-chunk part of o alone, L = <o_intra, do>, by autograd:
    o_intra_t = s sum_{j<=t} exp(G_t - G_j) (q_t . k_j) v_j."""
    HV, H = x["v"].shape[2], x["q"].shape[2]
    v = x["v"].clone().requires_grad_(True)
    loss = 0.0
    for b, s, n in spans:
        sl = slice(s, s + n)
        qc, kc = (x[t][b, sl].repeat_interleave(HV // H, dim=1).transpose(0, 1) for t in "qk")
        Gc = x["step"][b, sl].cumsum(0).transpose(0, 1)
        later = torch.ones(n, n, dtype=torch.bool).triu(1)
        decay = (Gc[:, :, None] - Gc[:, None, :]).masked_fill(later, float("-inf")).exp()
        o = scale * ((qc @ kc.transpose(1, 2)) * decay) @ v[b, sl].transpose(0, 1)
        loss = loss + (o * x["do"][b, sl].transpose(0, 1)).sum()
    return torch.autograd.grad(loss, v)[0]


@pytest.mark.parametrize("varlen", [False, True])
def test_dv_local_equals_autograd_of_the_in_chunk_output(varlen):
    """fla's `chunk_bwd_dv_local` (the kernel its gated backward runs before dqkwg; on an
    H200 under Triton 3.6 it faulted on a varlen batch), in torch: fixed-length rows with a
    partial last chunk, or varlen sequences whose chunks never cross a sequence."""
    BT, scale = 8, 0.3
    if varlen:
        lengths = [5, 17, 8]
        x = _inputs(1, sum(lengths), NT=1)  # (h, dh unused here)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        spans = [(0, int(cu[i]) + c * BT, min(BT, n - c * BT))
                 for i, n in enumerate(lengths) for c in range(-(-n // BT))]
    else:
        x, cu = _inputs(2, 19, NT=1), None
        spans = [(b, c * BT, min(BT, 19 - c * BT)) for b in range(2) for c in range(3)]
    want = _dv_local_reference(x, spans, scale)
    G = torch.zeros_like(x["step"])
    for b, s, n in spans:
        G[b, s:s + n] = x["step"][b, s:s + n].cumsum(0)
    f32 = {n: t.float() for n, t in x.items()}
    got = fla_dqkwg.chunk_bwd_dv_local(q=f32["q"], k=f32["k"], do=f32["do"],
                                       g=(G / math.log(2)).float(), scale=scale,
                                       cu_seqlens=cu, chunk_size=BT)
    assert got.shape == x["do"].shape and got.dtype == torch.float32
    assert (got.double() - want).abs().max() < 1e-5 * max(1.0, want.abs().max().item())
    ok = fla_dqkwg.dv_local_verifier
    assert ok(f32["q"], f32["k"], f32["do"], g=G)[0]
    assert not ok(f32["q"], f32["k"], f32["do"], g=None)[0]  # ungated
    assert not ok(f32["q"], f32["k"], f32["do"], g=G, A=torch.zeros(1))[0]  # scores given


def test_the_verifier_leaves_other_calls_to_fla():
    x = {n: t.float() for n, t in _inputs(1, 8, NT=1).items()}
    args = (x["q"], x["k"], x["v"], x["do"], x["h"], x["dh"])
    assert fla_dqkwg.verifier(*args, w=x["w"], g=x["step"], dv=x["dv"])[0]
    assert not fla_dqkwg.verifier(*args, w=x["w"], g=None, dv=x["dv"])[0]  # ungated
    assert not fla_dqkwg.verifier(*args, w=None, g=x["step"], dv=None)[0]  # not the delta rule
    assert not fla_dqkwg.verifier(*args, w=x["w"], g=x["step"], dv=x["dv"],
                                  g_gamma=torch.zeros(4))[0]


def test_fla_dispatches_its_refused_kernel_here_while_the_switch_is_on(monkeypatch):
    """On a card where fla refuses its kernel (the Hopper/Triton flags faked), the switch
    registers this function with fla's dispatch: fla's own entry point returns our result,
    and fla's backward counts as usable; switched off, fla refuses again (the torch rule
    trains). Runs where fla-core is installed (not CI's test extra)."""
    chunk_o = pytest.importorskip("fla.ops.common.chunk_o")
    import fla.utils

    from twinkled.engine import linear_attn as la

    for mod in (fla.utils, chunk_o):
        monkeypatch.setattr(mod, "IS_NVIDIA_HOPPER", True)
        monkeypatch.setattr(mod, "TRITON_ABOVE_3_4_0", True)
        monkeypatch.setattr(mod, "TRITON_ABOVE_3_7_1", False)
    x = {n: t.float() for n, t in _inputs(1, 20, NT=1).items()}
    kw = dict(q=x["q"], k=x["k"], v=x["v"], w=x["w"], g=x["step"].cumsum(1), h=x["h"],
              dv=x["dv"], do=x["do"], dh=x["dh"], scale=0.3, chunk_size=64)
    la.fla_backward_broken.cache_clear()
    try:
        assert la.fla_backward_broken()  # switch off: fla's backward is refused here
        with pytest.raises(RuntimeError):
            chunk_o.chunk_bwd_dqkwg(**kw)
        monkeypatch.setattr(la, "TORCH_DQKWG", True)
        la.fla_backward_broken.cache_clear()
        assert not la.fla_backward_broken()
        for a, b in zip(chunk_o.chunk_bwd_dqkwg(**kw), fla_dqkwg.chunk_bwd_dqkwg(**kw), strict=True):
            assert torch.equal(a, b)
        local = dict(q=kw["q"], k=kw["k"], do=kw["do"], g=kw["g"], scale=0.3, chunk_size=64)
        assert torch.equal(chunk_o.chunk_bwd_dv_local(**local),
                           fla_dqkwg.chunk_bwd_dv_local(**local))
        monkeypatch.setattr(la, "TORCH_DQKWG", False)  # registered, but the switch still rules
        with pytest.raises(RuntimeError):
            chunk_o.chunk_bwd_dqkwg(**kw)
    finally:
        la.fla_backward_broken.cache_clear()


def test_fla_backward_composed_with_it_equals_the_torch_rule_gradient():
    """A second check, on the whole rule: fla's backward orchestration (gated_delta_rule/
    chunk.py: state gradients dh, dv from its other kernels, then dqkwg, then the WY part's
    gradient added to dk and dg, then the reverse in-chunk cumsum of dg) composed with
    this function, the other kernels' results taken from autograd of the chunked graph,
    equals autograd of engine/linear_attn.py's `delta_rule` for q, k, v, g and beta."""
    from twinkled.engine import linear_attn as la

    gen = torch.Generator().manual_seed(2)
    B, T, H, K, V, BT = 2, 40, 2, 8, 6, 16
    scale = K**-0.5
    q, k = (la.l2norm(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)) for _ in "qk")
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(B, T, H, generator=gen, dtype=torch.float64) * 0.5
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    s0 = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64) * 0.1
    do, dS = torch.randn_like(v), torch.randn_like(s0)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta)]
    o, S = la.delta_rule(leaves[0] * scale, *leaves[1:], s0, chunk=BT)
    want = torch.autograd.grad((o * do).sum() + (S * dS).sum(), leaves)

    spans = [slice(s, min(s + BT, T)) for s in range(0, T, BT)]
    G = torch.cat([g[:, sl].cumsum(1) for sl in spans], 1)  # in-chunk cumulative log decay

    def wy(k, v, beta, G):
        """fla's w, u per chunk: (I + strictly lower beta_t k_t.k_j e^(G_t - G_j)) [w, u]
        = [beta e^G k, beta v]; then v_new = u - w h."""
        ws, us = [], []
        for sl in spans:
            kc, vc, bc, Gc = (t[:, sl].transpose(1, 2) for t in (k, v, beta, G))  # [B, H, n]
            n = kc.shape[2]
            lower = torch.ones(n, n, dtype=torch.bool).tril(-1)
            A = torch.eye(n, dtype=kc.dtype) + torch.where(
                lower, bc[..., None] * (kc @ kc.transpose(-1, -2))
                * (Gc[..., :, None] - Gc[..., None, :]).masked_fill(~lower, 0).exp(), 0.0)
            rhs = torch.cat([(bc * Gc.exp())[..., None] * kc, bc[..., None] * vc], -1)
            wu = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
            ws.append(wu[..., :K].transpose(1, 2))
            us.append(wu[..., K:].transpose(1, 2))
        return torch.cat(ws, 1), torch.cat(us, 1)

    # forward as fla's kernels compute it (chunk_gated_delta_rule_fwd_h, chunk_fwd_o), every
    # input held: the states' and v_new's total gradients are what fla's dhu kernel hands on
    w, u = (t.detach() for t in wy(k, v, beta, G))
    Sc, hs, nexts, vns, loss = s0.clone().requires_grad_(True), [], [], [], 0.0
    for sl in spans:
        qc, kc, Gc, wc, uc, doc = (t[:, sl].transpose(1, 2) for t in (q, k, G, w, u, do))
        vc = uc - wc @ Sc
        vc.retain_grad()
        n = qc.shape[2]
        decay = (Gc[..., :, None] - Gc[..., None, :]).masked_fill(
            torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")).exp()
        oc = scale * (Gc.exp()[..., None] * (qc @ Sc) + ((qc @ kc.transpose(-1, -2)) * decay) @ vc)
        loss = loss + (oc * doc).sum()
        hs.append(Sc)
        vns.append(vc)
        Sc = Gc[..., -1:, None].exp() * Sc + (kc * (Gc[..., -1:] - Gc).exp()[..., None]
                                              ).transpose(-1, -2) @ vc
        Sc.retain_grad()
        nexts.append(Sc)
    (loss + (Sc * dS).sum()).backward()

    def flat(ts):  # per chunk [B, H, ...] -> fla's [B, NT, H, ...]
        return torch.stack([t.detach() for t in ts], 1)
    v_new = torch.cat([t.detach().transpose(1, 2) for t in vns], 1)
    dv = torch.cat([t.grad.transpose(1, 2) for t in vns], 1)
    dq, dk, dw, dG = fla_dqkwg.chunk_bwd_dqkwg(
        q=q, k=k, v=v_new, do=do, h=flat(hs), dh=flat([t.grad for t in nexts]), w=w,
        g=G / math.log(2), dv=dv, scale=scale, chunk_size=BT)
    # prepare_wy_repr_bwd's part: (w, u)'s gradients (dw, du = dv) onto k, v, beta and G
    wy_leaves = [t.clone().requires_grad_(True) for t in (k, v, beta, G)]
    dk2, dv_in, dbeta, dG2 = torch.autograd.grad(wy(*wy_leaves), wy_leaves, (dw, dv))
    dG = dG + dG2  # then chunk_local_cumsum(reverse=True): G is g's in-chunk cumsum
    dg = torch.cat([dG[:, sl].flip(1).cumsum(1).flip(1) for sl in spans], 1)
    for name, a, b in zip("q k v g beta".split(), (dq, dk + dk2, dv_in, dg, dbeta), want, strict=True):
        assert (a - b).abs().max() < 1e-5 * max(1.0, b.abs().max().item()), name
