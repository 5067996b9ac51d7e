"""Losses with Tinker's semantics: per-token, summed over tokens and datums, never averaged.

lp = the learner's logprob of the target token; q = the sampler's logprob (`logprobs`
input); A = `advantages`. Each function returns the per-token (elementwise) loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .checks import LOSS_SIGNATURES
from .types import EngineInputError


def cross_entropy(lp, inp, cfg):
    weights = inp.get("weights")
    return -lp if weights is None else -lp * weights


def importance_sampling(lp, inp, cfg):
    return -torch.exp(lp - inp["logprobs"]) * inp["advantages"]


def ppo(lp, inp, cfg):
    ratio = torch.exp(lp - inp["logprobs"])
    lo, hi = _clip_bounds(inp, cfg)
    adv = inp["advantages"]
    return -torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv)


def cispo(lp, inp, cfg):
    ratio = torch.exp(lp - inp["logprobs"]).detach()
    lo, hi = _clip_bounds(inp, cfg)
    return -torch.clamp(ratio, lo, hi) * lp * inp["advantages"]


def dro(lp, inp, cfg):
    beta = cfg["beta"]
    return -(lp * inp["advantages"] - 0.5 * beta * (lp - inp["logprobs"]) ** 2)


def _clip_bounds(inp, cfg):
    # Per-token thresholds may arrive as loss inputs; otherwise the config's, else 0.8/1.2.
    lo = inp.get("clip_low_threshold", cfg.get("clip_low_threshold", 0.8))
    hi = inp.get("clip_high_threshold", cfg.get("clip_high_threshold", 1.2))
    return lo, hi


@dataclass(frozen=True)
class LossSpec:
    fn: Callable
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    config: tuple[str, ...] = ()
    required_config: tuple[str, ...] = ()


_FUNCTIONS = {"cross_entropy": cross_entropy, "importance_sampling": importance_sampling,
              "ppo": ppo, "cispo": cispo, "dro": dro}
# What each loss takes is part of the rules checked at the door (checks.py).
LOSSES: dict[str, LossSpec] = {name: LossSpec(_FUNCTIONS[name], *sig)
                               for name, sig in LOSS_SIGNATURES.items()}


def loss_spec(name: str) -> LossSpec:
    if name not in LOSSES:
        raise EngineInputError(
            "loss_fn", f"unknown loss {name!r}; built-in losses: {', '.join(LOSSES)}")
    return LOSSES[name]


class _TargetLogprobs(torch.autograd.Function):
    """log_softmax(logits)[target] in fp32, a chunk of tokens at a time; targets may carry
    a trailing K (several ids per position: top-K distillation).

    Full fp32 logits for a long batch would take tokens x vocab x 4 bytes (2.5 GB for 4k
    tokens of a 152k vocabulary), and autograd's log_softmax would keep another copy; here
    only the model's own logits (in its dtype) and one fp32 number per token are kept.
    """

    @staticmethod
    def forward(ctx, logits, targets, chunk):
        flat = logits.reshape(-1, logits.shape[-1])
        tgt = targets.reshape(flat.shape[0], -1)  # [tokens, K]
        lse = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
        for s in range(0, flat.shape[0], chunk):
            lse[s:s + chunk] = torch.logsumexp(flat[s:s + chunk].float(), dim=-1)
        lp = flat.gather(1, tgt).float() - lse[:, None]
        ctx.save_for_backward(logits, targets, lse)
        ctx.chunk = chunk
        return lp.view(targets.shape)

    @staticmethod
    def backward(ctx, grad_lp):
        logits, targets, lse = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        tgt = targets.reshape(flat.shape[0], -1)
        g = grad_lp.reshape(flat.shape[0], -1).float()
        total = g.sum(1, keepdim=True)
        grad = torch.empty_like(flat)
        for s in range(0, flat.shape[0], ctx.chunk):
            e = min(s + ctx.chunk, flat.shape[0])
            # d lp_k / d logits = onehot(target_k) - softmax, summed over the K targets
            part = torch.exp(flat[s:e].float() - lse[s:e, None]).mul_(-total[s:e])
            part.scatter_add_(1, tgt[s:e], g[s:e])
            grad[s:e] = part.to(grad.dtype)
        return grad.view(logits.shape), None, None


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                    chunk_bytes: int = 256 * 2**20) -> torch.Tensor:
    """Per-token logprob of `targets` [B, S] (or [B, S, K]) under `logits` [B, S, V], as
    fp32 of the targets' shape."""
    chunk = max(1, chunk_bytes // (4 * logits.shape[-1]))
    return _TargetLogprobs.apply(logits, targets, chunk)
