"""The LoRA deltas' matmuls and their backwards (which add to the banks' gradient buffers).

Mixtures, from each row's weights (gathered, or a slice of the bank where the rows' slots
run in order): `_LoraDelta` one module at a time; `SharedDelta` for linears that read the
same input (q/k/v read the normed hidden states, gate/up theirs): one matmul of x with the
group's A's side by side ([rows, m * r, in]), then each module's B, in place of one A
matmul per module; the backward likewise takes the A's gradients and x's gradient in one
matmul each, in place of m. Every module's own delta and gradients are what _LoraDelta
gives it; only the matmul count changes: on an H200, 8 adapters x 1 x 512 at the 8B's
q/k/v sizes (r=32), a layer's q/k/v LoRA forward + backward took 0.41 ms against 0.64 ms.

One adapter on every row: `lone_deltas` (below), plain matmuls on its slot's views.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def shared_delta(x: torch.Tensor, A: torch.Tensor, scale: torch.Tensor,
                 Bs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each module's delta, no autograd: x [n, S, in], A [n, m r, in], Bs m x [n, out_i, r]."""
    h = torch.bmm(x, A.transpose(1, 2)) * scale
    return [torch.bmm(part, B.transpose(1, 2)) for part, B in zip(_parts(h, len(Bs)), Bs,
                                                                      strict=True)]


class _LoraDelta(torch.autograd.Function):
    """delta = scale * (x @ A[slot]^T) @ B[slot]^T per row (added to y inside the B
    matmul if given); backward fills the bank grads at `rows` (lora_fused.accumulate)."""

    @staticmethod
    def forward(ctx, x, anchor, A_rows, B_rows, gA, gB, rows, scale, *ys):
        h = torch.bmm(x, A_rows.transpose(1, 2)) * scale  # [n, S, r]
        ctx.save_for_backward(x, A_rows, B_rows, h, scale)
        ctx.grads, ctx.rows, ctx.add = (gA, gB), rows, bool(ys)
        if ys:
            return torch.baddbmm(ys[0], h, B_rows.transpose(1, 2))
        return torch.bmm(h, B_rows.transpose(1, 2))  # [n, S, out]

    @staticmethod
    def backward(ctx, grad_out):
        x, A_rows, B_rows, h, scale = ctx.saved_tensors
        gA, gB = ctx.grads
        go = grad_out.to(h.dtype)
        grad_h = torch.bmm(go, B_rows) * scale  # [n, S, r]
        accumulate(gB, ctx.rows, go.transpose(1, 2), h)
        accumulate(gA, ctx.rows, grad_h.transpose(1, 2), x)
        grad_x = torch.bmm(grad_h, A_rows) if ctx.needs_input_grad[0] else None
        return (grad_x, None, None, None, None, None, None, None,
                *((grad_out,) if ctx.add else ()))


class SharedDelta(torch.autograd.Function):
    """shared_delta with a backward that adds each module's gradients to its bank buffers
    (`grads`: the A's gradients side by side [slots, m r, in] if they sit so in the bank
    (Bank.stacked), else None; and (gA, gB) per module), at `rows` (`accumulate`). With
    `ys`, each delta is added to its base output inside the B matmul (baddbmm)."""

    @staticmethod
    def forward(ctx, x, anchor, A, rows, scale, grads, Bs, *ys):
        h = torch.bmm(x, A.transpose(1, 2)) * scale  # [n, S, m r]
        ctx.save_for_backward(x, A, h, scale, *Bs)
        ctx.rows, ctx.grads, ctx.add = rows, grads, bool(ys)
        parts = _parts(h, len(Bs))
        if ys:
            return tuple(torch.baddbmm(y, p, B.transpose(1, 2))
                         for y, p, B in zip(ys, parts, Bs, strict=True))
        return tuple(torch.bmm(p, B.transpose(1, 2)) for p, B in zip(parts, Bs, strict=True))

    @staticmethod
    def backward(ctx, *grad_outs):
        x, A, h, scale, *Bs = ctx.saved_tensors
        stack, pairs = ctx.grads
        grad_h = []
        for part, B, go, (_, gB) in zip(_parts(h, len(Bs)), Bs, grad_outs, pairs, strict=True):
            go = go.to(h.dtype)
            accumulate(gB, ctx.rows, go.transpose(1, 2), part)
            grad_h.append(torch.bmm(go, B))
        grad_h = (torch.cat(grad_h, -1) if len(grad_h) > 1 else grad_h[0]) * scale
        if stack is not None:  # every module's A gradients in one matmul
            accumulate(stack, ctx.rows, grad_h.transpose(1, 2), x)
        else:
            for part, (ga, _) in zip(_parts(grad_h, len(Bs)), pairs, strict=True):
                accumulate(ga, ctx.rows, part.transpose(1, 2), x)
        grad_x = torch.bmm(grad_h, A) if ctx.needs_input_grad[0] else None
        return (grad_x, None, None, None, None, None, None,
                *(grad_outs if ctx.add else ()))


def accumulate(buf: torch.Tensor, rows: torch.Tensor | None, a: torch.Tensor,
               b: torch.Tensor) -> None:
    """Add each row's gradient a[i] @ b[i] to its slot of the fp32 `buf` (`rows`: each
    row's slot; an index_add, which wants fp32: a cast first), or with `rows` None to
    `buf` itself, the rows' own consecutive slots in the bank's scratch (Bank.scratch):
    the product and its sum in one kernel (baddbmm_)."""
    if rows is None:
        buf.baddbmm_(a, b)
    else:
        buf.index_add_(0, rows, torch.bmm(a, b).float())


def _parts(t: torch.Tensor, m: int, dim: int = -1) -> tuple[torch.Tensor, ...]:
    """The m modules' equal shares of the stacked rank dimension."""
    return (t,) if m == 1 else t.chunk(m, dim)


# -- one adapter on every row: plain matmuls -----------------------------------------------
#
# Where every row of a group (LoraBatch) or span (PackedLora) uses one adapter, the deltas
# need no gather of per-row weights, no batched matmul and no index_add: its weights and
# gradient buffers are views of its slot, x is one [tokens, in] matrix, and the base output
# takes the delta inside the B matmul (addmm). A lone tenant's step on the 8B issued ~40%
# of its ~7,000 host ops in the LoRA layers; this path cuts a module's ops from ~20 to ~9.


class LoneViews(NamedTuple):
    """One adapter's weights of modules that read one x, as views of its bank slot: the
    A's side by side [m r, in] (compute dtype) and transposed, their gradients; each
    module's B [out, r] and B^T, and its gradient transposed [r, out]. The gradients are
    in the bank's scratch (`Bank.scratch`: in the compute dtype, flushed to fp32)."""

    A: torch.Tensor
    At: torch.Tensor
    gA: torch.Tensor
    B: tuple[torch.Tensor, ...]
    Bt: tuple[torch.Tensor, ...]
    gBt: tuple[torch.Tensor, ...]


def lone_views(bank, slot: int, keys: tuple[str, ...]) -> LoneViews | None:
    """The views of modules `keys`, or None where their A's do not sit side by side in the
    bank (then they run one by one). Cached on the bank (`Bank.cached`): the same every
    step, and each view made is a host op."""
    def make():
        grads = bank.scratch()
        if len(keys) == 1:
            A, gA = bank.A16[keys[0]][slot], bank.part(grads, "A", keys[0])[slot]
        else:
            A, gA = bank.stacked("w16", keys), bank.stacked(grads, keys)
            if A is None:
                return None
            A, gA = A[slot], gA[slot]
        B = tuple(bank.B16[k][slot] for k in keys)
        return LoneViews(A, A.t(), gA, B, tuple(b.t() for b in B),
                         tuple(bank.part(grads, "B", k)[slot].t() for k in keys))

    return bank.cached(("lone", slot, keys), make)


def lone_deltas(bank, slot: int, scale: float, keys: tuple[str, ...], x: torch.Tensor,
                ys: list[torch.Tensor] | None, anchor: torch.Tensor) -> list[torch.Tensor]:
    """One adapter's deltas of modules `keys` over x [..., in]: each added to its base
    output ys[i] [..., out_i] if `ys` is given, else returned alone. Differentiable
    (gradients go to the bank's buffers) where grad is enabled. x and y are flattened to
    matrices inside (outside, every view would be an autograd node too)."""
    w = lone_views(bank, slot, keys)
    if w is None:  # A's not side by side: one module at a time
        return [lone_deltas(bank, slot, scale, (k,), x, None if ys is None else [ys[i]],
                            anchor)[0] for i, k in enumerate(keys)]
    if torch.is_grad_enabled():
        bank.mark(slot)
        return list(LoneDelta.apply(x, anchor, w, scale, *(ys or ())))
    return _lone_forward_h(x, torch.mm(_matrix(x), w.At), scale, w.Bt, ys)


def _matrix(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def _lone_forward_h(x, h, scale, Bts, ys):
    """From h = x A^T (unscaled, [t, m r]): y_i + s h_i B_i^T in one addmm each, or the
    deltas, shaped as x is ([..., out_i])."""
    parts = _parts(h, len(Bts))
    if ys:
        out = [torch.addmm(_matrix(y), p, Bt, alpha=scale)
               for y, p, Bt in zip(ys, parts, Bts, strict=True)]
    else:
        out = [torch.mm(p, Bt).mul_(scale) for p, Bt in zip(parts, Bts, strict=True)]
    return [d if x.dim() == 2 else d.view(*x.shape[:-1], -1) for d in out]


class LoneDelta(torch.autograd.Function):
    """`lone_deltas` with a backward that adds the adapter's gradients to its slot's
    buffers: gB_i^T += s h_i^T g_i, gA += (s [g_i B_i]_i)^T x (all A's at once)."""

    @staticmethod
    def forward(ctx, x, anchor, w: LoneViews, scale, *ys):
        x2 = _matrix(x)
        h = torch.mm(x2, w.At)
        ctx.save_for_backward(x2, h)
        ctx.w, ctx.scale, ctx.add, ctx.shape = w, scale, bool(ys), x.shape
        return tuple(_lone_forward_h(x, h, scale, w.Bt, ys))

    @staticmethod
    def backward(ctx, *grad_outs):
        x, h = ctx.saved_tensors
        w, s = ctx.w, ctx.scale
        grad_h = []
        for part, B, go, gBt in zip(_parts(h, len(w.B)), w.B, grad_outs, w.gBt, strict=True):
            go = _matrix(go.to(h.dtype))
            gBt.addmm_(part.t(), go, alpha=s)
            grad_h.append(torch.mm(go, B))
        grad_h = (torch.cat(grad_h, 1) if len(grad_h) > 1 else grad_h[0]).mul_(s)
        w.gA.addmm_(grad_h.t(), x)
        grad_x = torch.mm(grad_h, w.A).view(ctx.shape) if ctx.needs_input_grad[0] else None
        return (grad_x, None, None, None, *(grad_outs if ctx.add else ()))
