"""Losses with Tinker's semantics: per-token, summed over tokens and datums, never averaged.

lp = the learner's logprob of the target token; q = the sampler's logprob (`logprobs`
input); A = `advantages`. Each function returns the per-token (elementwise) loss of ONE
datum: the step calls it once per datum, so a sequence-level quantity (gspo's ratio) is
taken over exactly one sampled sequence.

Where each definition comes from (facts, not code, carry over):
- cross_entropy, importance_sampling, ppo, cispo, dro: Tinker's docs, "Loss functions"
  (tinker-docs.thinkingmachines.ai/tinker/losses/ and its per-loss pages).
- gspo: Tinker's GSPO page (.../tinker/losses/gspo/): GSPO-token (Zheng et al. 2025).
- stable_reinforce: see `stable_reinforce` below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from twinkled.protocol.checks import LOSS_SIGNATURES
from twinkled.protocol.types import EngineInputError

# dro's beta when loss_fn_config has none. Tinker's DRO page shows beta=0.05 (its only value;
# the page names no other), and public guides to the Tinker API give 0.05 as the default.
DRO_BETA = 0.05
# stable_reinforce's sampler-KL weight when loss_fn_config has none: 0.01, per the
# tinker-cookbook 0.6.1 changelog ("stable_reinforce adds a small sampler KL term by default
# (kl_coeff=0.01 in loss_fn_config)").
KL_COEFF = 0.01


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
    beta = cfg.get("beta", DRO_BETA)
    return -(lp * inp["advantages"] - 0.5 * beta * (lp - inp["logprobs"]) ** 2)


def gspo(lp, inp, cfg):
    """GSPO-token. The sequence log-ratio is the mean of lp - q over the tokens that
    `sequence_ratio_mask` marks (non-zero); every token's ratio takes the value exp(that
    mean) but the gradient of its own lp (value s, gradient s * d lp_t), then PPO's clipped
    objective, per token."""
    marked = inp["sequence_ratio_mask"] != 0
    log_s = (lp.detach() - inp["logprobs"])[marked].mean()  # checked non-empty at the door
    ratio = torch.exp(log_s + (lp - lp.detach()))
    lo, hi = _clip_bounds(inp, cfg)
    adv = inp["advantages"]
    return -torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv)


def stable_reinforce(lp, inp, cfg):
    """REINFORCE that stays stable when the sampler's policy differs from the learner's.

    What Tinker publishes (docs, .../tinker/losses/stable-reinforce/; SDK 0.38; cookbook
    0.6.1): it is a REINFORCE variant for off-policy and mixed-numerics data; it reads
    information recorded at sampling time (`record_stability_info=True`), found through the
    datum's provenance spans; it takes advantages only on sampled tokens; `kl_coeff` (default
    0.01) weighs "a small sampler KL term". Tinker does not publish the objective itself
    (the page's formula section could not be read from here), so this is twinkled's own,
    built from those facts. With q the recorded sampler logprob, r = exp(lp - q) and m = 1
    on sampled tokens (0 elsewhere):

        loss_t = m_t * ( -sg(min(r_t, 1)) * A_t * lp_t  +  kl_coeff * (r_t - 1 - log r_t) )

    The first term is REINFORCE whose importance weight is truncated at 1: stale or
    mismatched samples can only be down-weighted, never amplified (what makes plain
    importance sampling blow up). The second is the k3 estimate, from the sampler's own
    samples, of KL(sampler || learner): >= 0, zero on-policy, gradient kl_coeff*(r - 1).
    On-policy (r = 1) the whole loss is plain REINFORCE, -A * lp.
    """
    sampled = inp["sampled_mask"] != 0
    # Off the sampled tokens q means nothing: take r = 1 there, so nothing overflows.
    q = torch.where(sampled, inp["sampler_logprobs"], lp.detach())
    log_r = lp - q
    r = torch.exp(log_r)
    policy = -r.detach().clamp(max=1.0) * inp["advantages"] * lp
    kl = cfg.get("kl_coeff", KL_COEFF) * (r - 1.0 - log_r)
    return torch.where(sampled, policy + kl, torch.zeros_like(lp))


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
              "ppo": ppo, "cispo": cispo, "dro": dro, "gspo": gspo,
              "stable_reinforce": stable_reinforce}
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
        grad = logprob_grad(flat, lse, tgt, g, g.sum(1, keepdim=True), ctx.chunk)
        return grad.view(logits.shape), None, None


def logprob_grad(flat: torch.Tensor, lse: torch.Tensor, index: torch.Tensor, g: torch.Tensor,
                 total: torch.Tensor, chunk: int) -> torch.Tensor:
    """The gradient of sum_k g_k * lp_k over logits [tokens, V], lp_k = logits[index_k] - lse:
    d lp_k / d logits = onehot(index_k) - softmax, so g scattered at the targets minus the
    softmax times `total` (sum_k g_k), a chunk of tokens at a time."""
    grad = torch.empty_like(flat)
    for s in range(0, flat.shape[0], chunk):
        e = min(s + chunk, flat.shape[0])
        part = torch.exp(flat[s:e].float() - lse[s:e, None]).mul_(-total[s:e])
        part.scatter_add_(1, index[s:e], g[s:e])
        grad[s:e] = part.to(grad.dtype)
    return grad


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                    chunk_bytes: int = 256 * 2**20) -> torch.Tensor:
    """Per-token logprob of `targets` [B, S] (or [B, S, K]) under `logits` [B, S, V], as
    fp32 of the targets' shape."""
    chunk = max(1, chunk_bytes // (4 * logits.shape[-1]))
    return _TargetLogprobs.apply(logits, targets, chunk)
