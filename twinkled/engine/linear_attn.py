"""Linear attention with a recurrent state: the gated delta rule and its short causal conv.

Qwen3.5 / Qwen3-Next's Gated DeltaNet layers keep, per sequence, a state S [heads, dk, dv]
and the last K-1 inputs of a depthwise causal conv instead of a KV cache. Token t:

    S  <- exp(g_t) S                      (decay, g_t <= 0)
    u  =  beta_t (v_t - S^T k_t)          (the delta rule: write only what S mispredicts)
    S  <- S + k_t u^T ;   o_t = S^T q_t

`delta_rule` runs a whole sequence in chunks (within a chunk the updates are one
unit-triangular solve; the state passes from chunk to chunk), `delta_step` one token.
Sequences are independent rows of a batch [N, L, ...], right padded: a padded position
has beta = 0 and g = 0, so it neither decays nor writes the state, and every row's final
state is the state after its last real token. Packed training rows and prefill pieces are
cut into such rows (`to_rows`/`from_rows`), so no state leaks across a row boundary.

On CUDA the chunked rule runs fla-core's Triton kernel where it is installed (`fla_rule`,
varlen through cu_seqlens); the torch path here is the reference and the CPU path.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

CHUNK = 64
# fla-core's gated backward on Hopper under Triton < 3.7.1 with our torch `chunk_bwd_dqkwg`
# (engine/fla_dqkwg.py) in place of its one wrong kernel. Off until tests/test_qwen35_gpu.py
# (-k torch_dqkwg) has passed on such a card; off, training there takes the torch rule.
# TWINKLE_TORCH_DQKWG=1 turns it on for a process and its workers (the GPU bench's A/B).
TORCH_DQKWG = os.environ.get("TWINKLE_TORCH_DQKWG") == "1"


def to_rows(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """[1, T, ...] holding sequences end to end -> [N, max(lengths), ...], right padded."""
    parts = torch.split(x[0], lengths)
    return torch.nn.utils.rnn.pad_sequence(parts, batch_first=True)


def from_rows(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """The inverse of `to_rows`: [N, L, ...] -> [1, sum(lengths), ...]."""
    return torch.cat([x[i, :n] for i, n in enumerate(lengths)])[None]


def valid(lengths: list[int], width: int, device) -> torch.Tensor:
    """[N, width] True at each row's real positions."""
    return torch.arange(width, device=device)[None] < torch.tensor(lengths, device=device)[:, None]


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None,
                lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv then SiLU over rows x [N, L, C] (weight [C, K]), each row
    continuing its `state` [N, C, K-1] (None: zeros, a fresh sequence). Returns the output
    [N, L, C] and each row's next state: its last K-1 inputs, after its real tokens."""
    N, L, C = x.shape
    K = weight.shape[-1]
    if state is None:
        state = x.new_zeros(N, C, K - 1)
    full = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [N, C, K-1+L]
    y = F.silu(F.conv1d(full, weight[:, None, :].to(x.dtype), groups=C))
    if all(n == L for n in lengths):  # (decode: no index tensor to copy to the device)
        return y.transpose(1, 2), full[:, :, L:]
    ends = torch.tensor(lengths, device=x.device)[:, None] + torch.arange(K - 1, device=x.device)
    tail = full.gather(2, ends[:, None, :].expand(N, C, K - 1))
    return y.transpose(1, 2), tail


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, state: torch.Tensor | None, chunk: int = CHUNK
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over rows: q, k [N, L, H, dk] (l2-normalised, q scaled),
    v [N, L, H, dv], g, beta [N, L, H] (zero at padded positions), state [N, H, dk, dv]
    fp32 or None. Returns o [N, L, H, dv] (q's dtype) and the final state (fp32)."""
    dtype = q.dtype
    N, L, H, dk = k.shape
    dv = v.shape[-1]
    C = min(chunk, L)
    pad = (-L) % C
    # [N, H, n, C, ...] in fp32
    q, k, v = (F.pad(t.float(), (0, 0, 0, 0, 0, pad)).transpose(1, 2).reshape(N, H, -1, C, t.shape[-1])
               for t in (q, k, v))
    g, beta = (F.pad(t.float(), (0, 0, 0, pad)).transpose(1, 2).reshape(N, H, -1, C) for t in (g, beta))
    gc = g.cumsum(-1)  # log decay from the chunk's start to each position, inclusive
    later = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    # decay[t, s] = exp(gc_t - gc_s) for s <= t (masked before the exp: no overflow)
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(later, float("-inf")).exp()
    kk = (k @ k.transpose(-1, -2)) * decay
    # (I + A) u = beta v - beta exp(gc) k S0, A strictly lower: A[t, s] = beta_t decay[t, s] k_t.k_s
    system = torch.eye(C, device=q.device) + (beta[..., None] * kk).masked_fill(~later.t() | torch.eye(
        C, dtype=torch.bool, device=q.device), 0.0)
    # one triangular solve for both right-hand sides (one kernel, one backward)
    wkd = torch.linalg.solve_triangular(
        system, torch.cat([beta[..., None] * v, (beta * gc.exp())[..., None] * k], dim=-1),
        upper=False, unitriangular=True)
    w, kd = wkd.split([dv, dk], dim=-1)
    qk = (q @ k.transpose(-1, -2)) * decay  # causal within the chunk (decay is 0 above)
    q_in = q * gc.exp()[..., None]  # reads of the chunk's initial state
    k_out = k * (gc[..., -1:] - gc).exp()[..., None]  # writes, decayed to the chunk's end
    end = gc[..., -1].exp()[..., None, None]
    S = q.new_zeros(N, H, dk, dv) if state is None else state.float()
    outs = []
    # The chunks by unbind, not by indexing each: an index's backward writes its gradient
    # into a zero tensor of the whole input, once per chunk (measured on an H200: copies,
    # fills and adds were ~half of the rule's device time at 8 chunks); unbind's stacks once.
    chunks = zip(*(t.unbind(2) for t in (w, kd, q_in, qk, k_out, end)), strict=True)
    for w_i, kd_i, q_i, qk_i, k_i, end_i in chunks:
        u = w_i - kd_i @ S
        outs.append(q_i @ S + qk_i @ u)
        S = S * end_i + k_i.transpose(-1, -2) @ u
    o = torch.stack(outs, 2).reshape(N, H, -1, dv)[:, :, :L].transpose(1, 2)
    return o.to(dtype), S


def delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, state: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row (decode): shapes as `delta_rule` with L = 1."""
    dtype = q.dtype
    q, k, v, g, beta = (t[:, 0].float() for t in (q, k, v, g, beta))
    N, H, dk = k.shape
    S = q.new_zeros(N, H, dk, v.shape[-1]) if state is None else state.float()
    S = S * g.exp()[..., None, None]
    u = (v - (k[..., None] * S).sum(-2)) * beta[..., None]
    S = S + k[..., None] * u[..., None, :]
    o = (q[..., None] * S).sum(-2)
    return o[:, None].to(dtype), S


def fla_usable(x: torch.Tensor, backward: bool = False) -> bool:
    """fla-core's Triton kernels: CUDA only, where the package is installed, and for a pass
    that will run backward only where fla's gated backward is right on this card."""
    if not x.is_cuda:
        return False
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return not (backward and fla_backward_broken())


@functools.cache
def fla_backward_broken() -> bool:
    """fla-core refuses its gated chunked backward on Hopper under Triton >= 3.4, < 3.7.1
    (wrong results there: fla issue 640) by raising in the middle of a step; the torch rule
    trains instead (slower, right), and the forward passes (sampling, prefill) keep fla.
    With TORCH_DQKWG on, our torch version of that kernel is registered with fla there and
    fla's backward is usable. (Cached: clear it after changing the switch.)"""
    try:
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except ImportError:  # a later fla without these flags: trust it
        return False
    broken = bool(IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1)
    if broken and TORCH_DQKWG:  # the one wrong kernel replaced: the rest of fla's backward is right
        from twinkled.engine import fla_dqkwg

        try:
            fla_dqkwg.register(lambda: TORCH_DQKWG)
        except ImportError:  # an fla without its backend registry: the torch rule trains
            log.exception("registering the torch chunk_bwd_dqkwg with fla-core failed")
        else:
            log.info("fla-core's gated delta-rule backward on this Hopper/Triton: torch chunk_bwd_dqkwg")
            return False
    if broken:
        log.warning("fla-core's gated delta-rule backward is wrong on Hopper under this "
                    "Triton (< 3.7.1): Qwen3.5 linear attention trains with the torch rule")
    return broken


def fla_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, state: torch.Tensor | None, lengths: list[int]
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """`delta_rule` by fla-core's chunked Triton kernel, over rows as `delta_rule` takes
    them but q, k [N, L, Hk, dk] as the projection gives them (the kernel repeats the key
    heads over the value heads, l2-normalises and scales): the rows' real tokens packed end
    to end, cut by cu_seqlens, so padding costs nothing."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    cu_cpu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q, k, v, g, beta = (from_rows(t, lengths) for t in (q, k, v, g, beta))
    o, S = chunk_gated_delta_rule(q, k, v, g=g.float(), beta=beta.to(q.dtype),
                                  scale=q.shape[-1]**-0.5,
                                  initial_state=None if state is None else state.float(),
                                  output_final_state=True, use_qk_l2norm_in_kernel=True,
                                  cu_seqlens=cu_cpu.to(q.device), cu_seqlens_cpu=cu_cpu)
    return to_rows(o, lengths), S


def fla_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, state: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """`delta_step` (one token per row, decode) by fla-core's fused recurrent kernel; q, k
    as `fla_rule` takes them. The state stays fp32."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    return fused_recurrent_gated_delta_rule(
        # by keyword: the fifth positional parameter here is `gk` (per-key decay), not beta
        q, k, v, g=g.float(), beta=beta.to(q.dtype), scale=q.shape[-1]**-0.5,
        initial_state=None if state is None else state.float(), output_final_state=True,
        use_qk_l2norm_in_kernel=True)
