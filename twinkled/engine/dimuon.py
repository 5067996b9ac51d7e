"""Dimuon, Tinker's second optimizer: Muon applied to every LoRA matrix of an adapter.

What Tinker publishes about it, and where (no implementation of it is public):
- SDK 0.38, tinker/types/optimizer.py: `DimuonOptimizerConfig{type: "dimuon", version: 1}`
  is chosen at model creation; `DimuonParams{learning_rate >= 0, grad_clip_norm = 0.0
  ("Nonpositive values disable gradient clipping"), beta1 = 0.9 in [0, 1) ("EMA coefficient
  for the momentum")}`, no inf/NaN. TrainingClient.optim_step: params must match "the
  optimizer selected at model creation".
- tinker-docs.thinkingmachines.ai/tinker/optimizers: two optimizers, AdamW (default) and
  Dimuon; the optimizer stays fixed for the lifetime of the training client.
- tinker-docs .../api-reference/types/dimuonparams (a newer SDK than 0.38): learning_rate is
  "applied to a direction with Frobenius norm sqrt(rank), with rank correction applied
  uniformly to all LoRA matrices"; "Matrix-sign iteration count and normalization epsilon
  are internal constants"; `rank_lr_correction_exponent` (default 0.175) is the "Exponent
  for learning-rate correction relative to rank 32. Zero disables rank correction";
  `damping` (default 1e-4) "smooths the row and column preconditioner".
- .../api-reference/types/dimuonoptimizerconfig: "Dimuon identity retained by full-state
  resume" (a checkpoint with optimizer state brings the optimizer family back with it).
- The matrix sign and its constants are Muon's, as torch.optim.Muon (torch 2.13,
  torch/optim/_muon.py) implements it after Keller Jordan's post
  (kellerjordan.github.io/posts/muon): EMA momentum `buf.lerp_(grad, 1 - momentum)`, Nesterov
  by default, then 5 quintic Newton-Schulz steps, coefficients (3.4445, -4.7750, 2.0315), on
  the momentum scaled to Frobenius norm 1 (eps 1e-7).

The rule, per adapter and step (our reading of the above; `tests/test_engine_dimuon.py`
computes it by hand and checks it against torch.optim.Muon):
    g <- the accumulated gradients; if grad_clip_norm c > 0 and their global norm |g| > c,
         all of them times c / |g| (the clipping AdamW steps share, `optim.py`)
    for each LoRA matrix X (every lora_A [r, in] and lora_B [out, r], each expert's own on an
    MoE model; an adapter's trainable
    parameters are all such matrices, so nothing falls back to another optimizer):
        m <- beta1 * m + (1 - beta1) * g              momentum (state; kept with the adapter)
        u <- (1 - beta1) * g + beta1 * m              Nesterov
        O <- NS5(u)     ~ U V^T for u = U S V^T: r singular values near 1, |O|_F ~ sqrt(r)
        X <- X - learning_rate * (32 / r) ** rank_lr_correction_exponent * O
The step size is the same for A and B ("uniformly"): torch.optim.Muon's shape adjustments
(sqrt(max(1, rows/cols)), or 0.2 sqrt(max(rows, cols))) would scale B's update by its height,
which is not a direction of norm sqrt(rank). The correction shrinks the step as the rank
grows: an update of norm sqrt(r) per matrix grows with r. Not implemented: the `damping`
(row and column preconditioner) of the newer SDK, whose rule Tinker does not publish;
0.38 clients never send it, and the daemon refuses a request that does. Under tensor
parallelism the sign is taken of each whole matrix (gathered), so a split model steps as
one rank would.

Why not call torch.optim.Muon: it steps one tensor at a time in a Python loop (15 kernels
per matrix, ~5000 per adapter of a 0.5B model) and runs the iteration in bfloat16. Here every
same-shaped matrix of every adapter stepping together is one batch of matmuls, in fp32 (a
LoRA matrix has r rows or columns, so the r x r Gram products cost little).
"""

from __future__ import annotations

import torch

from twinkled.protocol.types import DimuonParams

from .lora import Adapter

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
REFERENCE_RANK = 32


def msign(x: torch.Tensor) -> torch.Tensor:
    """The approximate orthogonal factor U V^T of each matrix of `x` [k, rows, cols]."""
    a, b, c = NS_COEFFICIENTS
    tall = x.shape[-2] > x.shape[-1]
    if tall:  # iterate on the wide orientation: its Gram matrix is the small one
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)  # spectral norm <= 1
    for _ in range(NS_STEPS):
        gram = x @ x.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b G + c G^2
        x = torch.baddbmm(x, poly, x, beta=a)  # a X + (b G + c G^2) X
    return x.mT if tall else x


def step_size(params: DimuonParams, rank: int) -> float:
    """learning_rate, corrected for the adapter's rank relative to rank 32."""
    return params.learning_rate * (REFERENCE_RANK / rank) ** params.rank_lr_correction_exponent


@torch.no_grad()
def dimuon_update(items: list[tuple[Adapter, DimuonParams]], shard=None) -> None:
    """Apply the rule to each adapter's (already clipped, finite) gradients.

    Momentum lives in the bank's first-moment buffers ("m"), which AdamW adapters use for
    exp_avg; the gradient buffers are overwritten with the Nesterov direction (the caller
    clears them after the step). Adapters sharing beta1 share one momentum kernel, and
    same-shaped matrices of all adapters share one Newton-Schulz batch.

    `shard` (tp.py): the banks hold tensor-parallel slices. The momentum is elementwise,
    but the matrix sign is of the whole matrix: each direction is gathered whole over the
    group (LoRA matrices have r rows or columns: small), every rank computes the same sign,
    and each keeps its slice of it."""
    by_beta: dict[float, list[Adapter]] = {}
    for adapter, p in items:
        by_beta.setdefault(p.beta1, []).append(adapter)
    for beta1, adapters in by_beta.items():
        g = [t for a in adapters for t in a.bank.tensors(a.slot, "g")]
        m = [t for a in adapters for t in a.bank.tensors(a.slot, "m")]
        torch._foreach_lerp_(m, g, 1.0 - beta1)  # m = beta1 m + (1 - beta1) g
        torch._foreach_lerp_(g, m, beta1)  # g = (1 - beta1) g + beta1 m
    groups: dict[tuple[int, ...], tuple[list, list, list, list]] = {}
    for adapter, p in items:
        lr = step_size(p, adapter.config.rank)
        bank, slot = adapter.bank, adapter.slot
        keys = list(bank.shapes)
        parts = [(k, part) for part in ("A", "B") for k in keys]  # as Bank.tensors orders
        directions = bank.tensors(slot, "g")
        if shard is not None:
            directions = shard.gather_views(keys, directions)
        for w, u, part in zip(bank.tensors(slot, "w"), directions, parts, strict=True):
            ws, us, lrs, where = groups.setdefault(tuple(u.shape), ([], [], [], []))
            ws.append(w)
            us.append(u)
            lrs.append(-lr)
            where.append(part)
    for ws, us, lrs, where in groups.values():
        u = torch.stack(us)  # an MoE expert pair is [experts, rows, cols]: one matrix each
        o = msign(u.reshape(-1, *u.shape[-2:])).reshape(u.shape)
        lr = torch.tensor(lrs, dtype=o.dtype).to(o.device, non_blocking=True)
        o.mul_(lr.view(-1, *[1] * (u.dim() - 1)))
        steps = list(o.unbind(0))
        if shard is not None:  # this rank's slice of each whole update
            steps = [shard.local_lora(k, part, x) for x, (k, part) in zip(steps, where,
                                                                          strict=True)]
        torch._foreach_add_(ws, steps)
