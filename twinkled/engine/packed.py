"""Packing without padding: a micro-batch's rows as ONE sequence of all their tokens.

Rows of different lengths (and different adapters) are laid end to end, so a batch costs
what its tokens cost. Each row is a *segment*: positions restart at its first token and
attention is causal within it and blind across it (block-diagonal). Rows are ordered by
adapter, so every adapter owns one contiguous span of tokens, and a LoRA module's delta
for the whole sequence is two grouped matmuls over those spans (`torch._grouped_mm`),
whatever the number of adapters.

Attention: flash attention's variable-length kernel (`torch.nn.attention.varlen`, or its aten
ops through flash_varlen.py where that is switched on) on a GPU in half precision; otherwise
(CPU, fp32) one SDPA call per segment, the same math.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from . import flash_varlen, lora
from .chunked_logprobs import Segment, segment
from .lora import Adapter, Bank, same_bank
from .lora_fused import lone_deltas

log = logging.getLogger(__name__)


@dataclass
class Packing:
    """Where each row's tokens sit in the packed sequence."""

    lengths: list[int]  # tokens of each row, in packed order
    cu: torch.Tensor  # [rows + 1] int32 segment starts (device)
    positions: torch.Tensor  # [1, T] position of each token within its row (device)

    @staticmethod
    def of(lengths: list[int], device) -> Packing:
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        cu = torch.tensor(starts, dtype=torch.int32, device=device)
        positions = torch.cat([torch.arange(n) for n in lengths]).to(device)[None]
        return Packing(lengths, cu, positions)

    @property
    def total(self) -> int:
        return sum(self.lengths)

    def memory_tokens(self) -> int:
        """Tokens a pass keeps for its backward (the recompute decision): its tokens."""
        return self.total

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               gqa: bool) -> torch.Tensor:
        """Block-diagonal causal attention. q [1, H, T, D], k/v [1, Hkv, T, D] -> [1, H, T, D]."""
        if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
            longest = max(self.lengths)
            if flash_varlen.available(q):  # kv heads as they are (flash_varlen.py)
                own = flash_varlen.Pass(self.cu, self.cu, longest, longest, True)
                return flash_varlen.attend(q, k, v, flash_varlen.Plan(own), scale)
            return varlen_attend(q, k, v, self.cu, self.cu, longest, longest, scale, gqa)
        outs, start = [], 0
        for n in self.lengths:
            s = slice(start, start + n)
            outs.append(F.scaled_dot_product_attention(
                q[:, :, s], k[:, :, s], v[:, :, s], is_causal=True, scale=scale,
                enable_gqa=gqa))
            start += n
        return torch.cat(outs, dim=2)


def varlen_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                  cu_k: torch.Tensor, max_q: int, max_k: int, scale: float,
                  gqa: bool) -> torch.Tensor:
    """Flash attention's variable-length kernel, causal (aligned to the end of each
    segment's keys where a segment has more keys than queries). q [1, H, Tq, D],
    k/v [1, Hkv, Tk, D] -> [1, H, Tq, D]."""
    from torch.nn.attention.varlen import varlen_attn

    # Causal: `window_size` in newer builds, `is_causal` in older ones.
    kw = ({"window_size": (-1, 0)} if _varlen_has("window_size")
          else {"is_causal": True})
    q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))  # token-major, as the kernel reads
    if gqa and _varlen_has("enable_gqa"):
        kw["enable_gqa"] = True
    elif gqa:  # a build whose kernel wants as many kv heads as query heads
        k, v = (repeat_kv_heads(t, q.shape[1] // t.shape[1]) for t in (k, v))
    out = varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(),
                      cu_q, cu_k, max_q, max_k, scale=scale, **kw)
    return out.transpose(0, 1)[None]


def repeat_kv_heads(t: torch.Tensor, times: int) -> torch.Tensor:
    """[T, Hkv, D] -> [T, Hkv * times, D], each kv head repeated in place (as
    `repeat_interleave(times, dim=1)`), written token-major in one copy: repeating the
    head-major [1, Hkv, T, D] and then making it token-major for the kernel copied every
    key twice (an 8B RL step's shared-prefix training spent 16% of its device time in
    such copies, bench_shared_prefix.py --profile)."""
    n, heads, dim = t.shape
    return t.unsqueeze(2).expand(n, heads, times, dim).reshape(n, heads * times, dim)


@cache
def _varlen_has(arg: str) -> bool:
    from torch.nn.attention.varlen import varlen_attn

    return arg in inspect.signature(varlen_attn).parameters


@dataclass
class _Span:
    bank: Bank
    start: int  # first token of the bank's span
    end: int
    slots: torch.Tensor  # [G] slot of each adapter of the span, in order
    offs: torch.Tensor  # [G] int32 end of each adapter's tokens, relative to `start`
    scale: torch.Tensor  # [end - start, 1] each token's adapter scale
    adapters: list[tuple[Adapter, int]]  # (adapter, tokens) of each, in order (host)
    lone: Adapter | None = None  # the span's one adapter, where it has one (and DIRECT)


class PackedLora:
    """Which adapter each token of a packed sequence uses (the packed LoraBatch).

    `apply(key, x, y)` adds the adapters' deltas of module `key` to its base output y [1, T, out].
    """

    def __init__(self, rows: list[tuple[Adapter | None, int]], dtype, device,
                 lone: bool | None = None):
        """`rows`: (adapter, tokens) in packed order; rows of one bank must be contiguous.
        `lone`: a span of one adapter takes plain matmuls (lora.DIRECT by default)."""
        lone = lora.DIRECT if lone is None else lone
        self.dtype = dtype
        self.spans: list[_Span] = []
        self.anchor = torch.zeros((), device=device, requires_grad=True)  # see LoraBatch
        t, i = 0, 0
        while i < len(rows):
            adapter, j, start = rows[i][0], i, t
            groups: list[tuple[Adapter, int]] = []  # (adapter, tokens) of this bank
            while j < len(rows) and same_bank(rows[j][0], adapter):
                a, n = rows[j]
                if groups and groups[-1][0] is a:
                    groups[-1] = (a, groups[-1][1] + n)
                else:
                    groups.append((a, n))
                t += n
                j += 1
            if adapter is not None:
                ends, scales, total = [], [], 0
                for a, n in groups:
                    total += n
                    ends.append(total)
                    scales.append(torch.full((n,), a.scale))
                self.spans.append(_Span(
                    adapter.bank, start, t,
                    torch.tensor([a.slot for a, _ in groups], device=device),
                    torch.tensor(ends, dtype=torch.int32, device=device),
                    torch.cat(scales).to(device=device, dtype=dtype)[:, None], groups,
                    groups[0][0] if lone and len(groups) == 1 else None))
            i = j
        if len({id(s.bank) for s in self.spans}) != len(self.spans):
            raise ValueError("rows of one bank must be contiguous")
        for s in self.spans:
            s.bank.refresh()

    def apply(self, key: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.apply_shared((key,), x, [y])[0]

    def apply_shared(self, keys: tuple[str, ...], x: torch.Tensor,
                     ys: list[torch.Tensor]) -> list[torch.Tensor]:
        """`apply` for modules that read one x (q/k/v; gate/up): a span of one adapter
        runs their A's as one matmul (lora_fused.lone_deltas); a mixed span one module at
        a time."""
        ys = list(ys)
        for s in self.spans:
            mine = [i for i, k in enumerate(keys) if k in s.bank.shapes]
            if s.lone is None:
                for i in mine:
                    ys[i] = self._mixed(s, keys[i], x, ys[i])
                continue
            if not mine:
                continue
            a, whole = s.lone, s.start == 0 and s.end == x.shape[1]
            ds = lone_deltas(a.bank, a.slot, a.scale, tuple(keys[i] for i in mine),
                             x if whole else x[0, s.start:s.end],
                             [ys[i] for i in mine] if whole else None, self.anchor)
            for i, d in zip(mine, ds, strict=True):
                if whole:
                    ys[i] = d
                else:
                    ys[i][0, s.start:s.end] += d  # y is the base linear's fresh output
        return ys

    def _mixed(self, s: _Span, key: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Module `key`'s deltas over a span of several adapters (grouped matmuls)."""
        if key in s.bank.shapes:
            A = s.bank.A16[key].index_select(0, s.slots).to(self.dtype)  # [G, r, in]
            B = s.bank.B16[key].index_select(0, s.slots).to(self.dtype)  # [G, out, r]
            xs = x[0, s.start:s.end]
            if torch.is_grad_enabled():
                d = _PackedDelta.apply(xs, self.anchor, A, B, s.bank.gA[key], s.bank.gB[key],
                                       s.slots, s.scale, s.offs)
            else:
                d = grouped_mm(grouped_mm(xs, A.transpose(1, 2), s.offs) * s.scale,
                               B.transpose(1, 2), s.offs)
            if s.start == 0 and s.end == x.shape[1]:
                y = y + d[None]
            else:
                y[0, s.start:s.end] += d  # y is the base linear's fresh output, not a view
        return y

    def segments(self, key: str, seq: int | None = None) -> list[Segment]:
        """Module `key`'s adapters over the packed tokens, one segment per adapter (the
        chunked head's view; `seq` is the row layout's and unused here), from the spans'
        host copy of the spans (no wait for the device)."""
        out: list[Segment] = []
        for s in self.spans:
            if key not in s.bank.shapes:
                continue
            start = s.start
            for a, n in s.adapters:
                out.append(segment(s.bank, a.slot, a.scale, key, start, start + n, self.dtype))
                start += n
        return out


class _PackedDelta(torch.autograd.Function):
    """delta = scale * (x @ A[g]^T) @ B[g]^T over each adapter g's tokens; the backward
    adds the adapters' gradients to the bank buffers (as the row layout's does)."""

    @staticmethod
    def forward(ctx, x, anchor, A, B, gA, gB, slots, scale, offs):
        h = grouped_mm(x, A.transpose(1, 2), offs) * scale  # [t, r]
        ctx.save_for_backward(x, A, B, h, slots, scale, offs)
        ctx.grads = (gA, gB)
        return grouped_mm(h, B.transpose(1, 2), offs)  # [t, out]

    @staticmethod
    def backward(ctx, grad_out):
        x, A, B, h, slots, scale, offs = ctx.saved_tensors
        gA, gB = ctx.grads
        grad_out = grad_out.to(h.dtype).contiguous()
        grad_h = grouped_mm(grad_out, B, offs) * scale  # [t, r]
        gB.index_add_(0, slots, grouped_weight_grad(grad_out, h, offs).float())
        gA.index_add_(0, slots, grouped_weight_grad(grad_h, x, offs).float())
        grad_x = grouped_mm(grad_h, A, offs) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None, None, None, None, None, None


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """out[rows of group g] = x[rows of g] @ w[g]; x [t, k], w [G, k, n], offs [G] ends."""
    if _grouped_ok(x, w):
        try:
            return torch._grouped_mm(x.contiguous(), w, offs=offs)
        except RuntimeError as e:  # a layout this build's kernel refuses: the loop below
            _slow_path(x, w, e)
    else:
        _slow_path(x, w, None)
    out, start = [], 0
    for g, end in enumerate(offs.tolist()):
        out.append(x[start:end] @ w[g])
        start = end
    return torch.cat(out)


def grouped_weight_grad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[G, n, m]: a[rows of g]^T @ b[rows of g] for each group g; a [t, n], b [t, m]."""
    if _grouped_ok(a, b):
        try:
            return torch._grouped_mm(a.t(), b.contiguous(), offs=offs)
        except RuntimeError as e:
            _slow_path(a, b, e)
    else:
        _slow_path(a, b, None)
    out, start = [], 0
    for end in offs.tolist():
        out.append(a[start:end].t() @ b[start:end])
        start = end
    return torch.stack(out)


_warned: set[tuple] = set()


def _slow_path(a: torch.Tensor, b: torch.Tensor, error: Exception | None) -> None:
    """Say once per layout when a GPU falls back to the loop over groups: it syncs with the
    host and launches a kernel per group, the MoE layers' main cost if it happens there."""
    key = (a.dtype, b.dtype, tuple(a.shape[1:]), tuple(b.shape[1:]))
    if a.is_cuda and key not in _warned:
        _warned.add(key)
        log.warning("grouped matmul fell back to a loop over groups: %s x %s %s%s", a.dtype,
                    b.dtype, tuple(b.shape), f" ({error})" if error else "")


def _grouped_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The grouped kernel wants 16-byte aligned rows (and bf16 on a GPU)."""
    if a.dtype != b.dtype or (a.is_cuda and a.dtype != torch.bfloat16):
        return False
    size = a.element_size()
    return all(d * size % 16 == 0 for d in (*a.shape[1:], *b.shape[1:]))


