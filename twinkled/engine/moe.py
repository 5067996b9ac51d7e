"""Mixture-of-experts layers: top-k routing, grouped expert matmuls, per-expert multi-LoRA.

The layout is the one transformers 5 gives Qwen3-MoE and Mixtral: a router `mlp.gate` (weight
[E, H], frozen) and the experts as two 3-D parameters, `mlp.experts.gate_up_proj`
[E, 2I, H] (gate and up fused) and `mlp.experts.down_proj` [E, H, I]. A token goes to its
top-k experts (softmax over all experts in fp32, then top-k; Qwen3 renormalises the k
weights when `norm_topk_prob`, Mixtral always does) and its output is their weighted sum.

LoRA on experts (`train_mlp`, as Tinker's train_mlp covers MoE): every expert has its own
LoRA pair on each of the two parameters, A [E, r, in] and B [E, out, r] per adapter: one
on the fused gate_up projection (in H, out 2I) and one on down (in I, out H). That is
exactly peft's `target_parameters` form for these parameters (peft's ParamWrapper keeps
lora_A [E*r, in] and lora_B [out, r*E], one independent rank-r pair per expert), so an
export loads in peft and gives the same logprobs (`moe_peft.py` converts the layouts).
A separate pair on gate and up would need a rank-2r block form in peft; the fused pair
round-trips as it is.

One pass for a batch of many adapters: (token, expert) pairs are sorted by expert, so the
frozen expert weights are one grouped matmul (`torch._grouped_mm` on a GPU; a loop over
experts on the CPU only, `packed.grouped_mm`); each bank's pairs are then sorted by
(expert, adapter) and its deltas are two more grouped matmuls over the E x adapters
groups. No Python loop over experts or adapters runs on the GPU path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from twinkled.protocol.types import EXPERT_MODULES, EngineInputError

from .lora import Adapter, Bank, LoraBatch
from .moe_parallel import ExpertSplit, copy_to_experts, reduce_from_experts
from .packed import PackedLora, grouped_mm, grouped_weight_grad

# torch._grouped_mm's CUDA kernel refuses 1024 groups or more ("Can't process more than
# 1024 groups"); an (expert, adapter) grouping stays under it.
MAX_GROUPS = 1023

# model_type -> whether the top-k weights are renormalised (None: the config says).
# Qwen3.5-MoE's text model (qwen35_moe.py) and Qwen3-VL-MoE's (vision.py) always
# renormalise, Qwen3-Next as its config says.
MOE_ARCHS = {"qwen3_moe": None, "mixtral": True, "qwen3_5_moe_text": True, "qwen3_next": None,
             "qwen3_vl_moe_text": True,
             "deepseek_v3": None, "kimi_k2": None}  # DeepSeek's routing: deepseek_moe.py
# Sparse blocks that also hold a gated shared expert (run beside the routed experts by
# qwen35_moe.py), and its parameters.
SHARED_EXPERT = ("qwen3_5_moe_text", "qwen3_next")
_ROUTED = ["experts.down_proj", "experts.gate_up_proj", "gate.weight"]
_SHARED = ["shared_expert.down_proj.weight", "shared_expert.gate_proj.weight",
           "shared_expert.up_proj.weight", "shared_expert_gate.weight"]


@dataclass
class BankTokens:
    """The tokens one bank's adapters own: `tokens` [n] flat token index, `unit` [n] the
    index of each token's adapter in `slots` [u] (distinct), `scale` [u] their scales."""

    bank: Bank
    tokens: torch.Tensor
    unit: torch.Tensor
    slots: torch.Tensor
    scale: torch.Tensor


class ExpertRows:
    """A running sampling batch's LoRA (lora_rows.py, prefill.py: `apply` on every linear)
    with, for the experts, the tokens each bank's adapters own (`run_tokens`): what a
    LoraBatch gives training. The expert deltas read the banks themselves (the adapter
    stack holds no expert columns: a copy of every expert's pair per adapter in use)."""

    def __init__(self, lora, banks: list[BankTokens]):
        self.lora, self.banks = lora, banks

    def apply(self, key: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.lora.apply(key, x, y)

    def row_factors(self, key: str):
        return self.lora.row_factors(key)


def run_tokens(runs: list[tuple[Adapter | None, int]], dtype: torch.dtype, device
               ) -> list[BankTokens]:
    """The BankTokens of a pass whose flat tokens come as runs of one adapter each (None:
    the base model): a running batch's prefill pieces, or its decode rows (1 token each)."""
    # bank -> its tokens, their slots and scales (host lists: one copy each to the device)
    by_bank: dict[int, tuple[Bank, list[int], list[int], list[float]]] = {}
    t = 0
    for a, n in runs:
        if a is not None and n:
            got = by_bank.get(id(a.bank))
            if got is None:
                a.bank.refresh()  # (the compute-dtype copy the deltas read)
                got = by_bank[id(a.bank)] = (a.bank, [], [], [])
            got[1].extend(range(t, t + n))
            got[2].extend([a.slot] * n)
            got[3].extend([a.scale] * n)
        t += n
    return [_distinct(bank, torch.tensor(tokens).to(device), torch.tensor(slots).to(device),
                      torch.tensor(scales, dtype=dtype).to(device))
            for bank, tokens, slots, scales in by_bank.values()]


def bank_tokens(lora: LoraBatch | PackedLora | ExpertRows | None, row_len: int
                ) -> list[BankTokens]:
    """Which adapter each flat token of a batch uses, by bank (computed once per forward:
    every MoE layer of the pass routes differently but with the same adapters)."""
    out: list[BankTokens] = []
    if lora is None:
        return out
    if isinstance(lora, ExpertRows):
        return lora.banks
    if isinstance(lora, LoraBatch):
        for g in lora.groups:
            dev = g.slots.device
            rows = torch.arange(g.start, g.end, device=dev)
            tokens = (rows[:, None] * row_len + torch.arange(row_len, device=dev)).reshape(-1)
            out.append(_distinct(g.bank, tokens, g.slots.repeat_interleave(row_len),
                                 g.scale.reshape(-1).repeat_interleave(row_len)))
        return out
    for s in lora.spans:
        dev = s.slots.device
        counts = torch.diff(s.offs.long(), prepend=s.offs.new_zeros(1).long())
        tokens = torch.arange(s.start, s.end, device=dev)
        out.append(_distinct(s.bank, tokens, s.slots.repeat_interleave(counts),
                             s.scale.reshape(-1)))
    return out


def _distinct(bank, tokens, token_slots, token_scale) -> BankTokens:
    """One unit per distinct adapter: its LoRA weights are gathered once, however many rows
    it has."""
    slots, unit = torch.unique(token_slots, return_inverse=True)
    scale = token_scale.new_zeros(len(slots)).scatter_(0, unit, token_scale)
    return BankTokens(bank, tokens, unit, slots, scale)


class MoeBlock:
    """One decoder layer's sparse MLP, run over the frozen weights of its HF module."""

    # Experts with biases (gpt-oss's, gpt_oss_moe.py) set these: [E, 2I] and [E, H].
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None

    def __init__(self, index: int, mlp, normalize: bool | None, top_k: int,
                 split: ExpertSplit | None = None):
        self.index = index
        self.router = mlp.gate.weight  # [E, H]
        # This rank's experts (all of them without expert parallelism; `shard_experts`
        # already dropped the others): the global experts `owned`.
        self.gate_up = mlp.experts.gate_up_proj  # [E_local, 2I, H]
        self.down = mlp.experts.down_proj  # [E_local, H, I]
        self.act = mlp.experts.act_fn
        self.n_experts = self.router.shape[0]
        self.split = split
        self.owned = (slice(0, self.n_experts) if split is None
                      else split.owned(self.n_experts, index))
        self.top_k = top_k
        self.normalize = normalize
        prefix = f"model.layers.{index}.mlp.experts."
        self.keys = {p: prefix + p for p in EXPERT_MODULES}

    def expert_parameters(self) -> list[torch.nn.Parameter]:
        """The module's per-expert parameters, experts first: what expert parallelism splits."""
        return [self.gate_up, self.down]

    def targets(self) -> dict[str, tuple[int, int, int]]:
        """The LoRA targets: key -> (in, out, experts); the banks keep every expert."""
        _, two_i, H = self.gate_up.shape
        E = self.n_experts
        return {self.keys["gate_up_proj"]: (H, two_i, E),
                self.keys["down_proj"]: (two_i // 2, H, E)}

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k experts [T, k] and their weights [T, k] (in x's dtype) for x [T, H]."""
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def __call__(self, x: torch.Tensor, banks: list[BankTokens]) -> torch.Tensor:
        """x [B, S, H] -> the layer's MLP output [B, S, H]."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if self.split is not None:
            flat = copy_to_experts(flat, self.split)
        experts, weights = self.route(flat)
        experts, weights = experts.reshape(-1), weights.reshape(-1)
        tokens = torch.arange(flat.shape[0], device=flat.device).repeat_interleave(self.top_k)
        if self.split is not None:  # only the pairs of this rank's experts
            lo, hi = self.owned.start, self.owned.stop
            keep = (experts >= lo) & (experts < hi)
            experts, weights, tokens = experts[keep] - lo, weights[keep], tokens[keep]
        out = self.expert_pairs(flat, experts, weights, banks, tokens)
        if self.split is not None:
            out = reduce_from_experts(out, self.split)
        return out.reshape(shape)

    def expert_pairs(self, flat: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                     banks: list[BankTokens], tokens: torch.Tensor) -> torch.Tensor:
        """The weighted expert outputs of (token, expert) pairs, summed per token [T, H].

        Pair j is token `tokens[j]` sent to local expert `experts[j]`."""
        T = flat.shape[0]
        order = torch.argsort(experts, stable=True)
        experts, tokens, weights = experts[order], tokens[order], weights[order]
        E = self.gate_up.shape[0]
        offs = torch.cumsum(torch.bincount(experts, minlength=E), 0).to(torch.int32)
        xs = flat.index_select(0, tokens)
        pairs = _PairAdapters.of(banks, tokens, experts, E, T, self.owned)
        gu = _ExpertMM.apply(xs, self.gate_up, offs)
        if self.gate_up_bias is not None:
            gu = gu + self.gate_up_bias[experts]
        mid = self.glu(pairs.add_deltas(self.keys["gate_up_proj"], xs, gu))
        y = _ExpertMM.apply(mid, self.down, offs)
        if self.down_bias is not None:
            y = y + self.down_bias[experts]
        y = pairs.add_deltas(self.keys["down_proj"], mid, y)
        y = y * weights[:, None]
        return flat.new_zeros(flat.shape).index_add(0, tokens, y)

    def glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The experts' gated activation of [gate | up] halves: act(gate) * up."""
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up


class _PairAdapters:
    """For expert-sorted pairs: which pairs each bank owns, sorted by (expert, adapter)."""

    def __init__(self, parts: list[tuple[BankTokens, torch.Tensor, torch.Tensor, torch.Tensor]],
                 owned: slice):
        self.parts = parts  # (bank tokens, its pair rows, their scales [p, 1], group ends)
        self.owned = owned  # the experts of the bank these pairs use

    @staticmethod
    def of(banks: list[BankTokens], tokens: torch.Tensor, experts: torch.Tensor, E: int,
           T: int, owned: slice) -> _PairAdapters:
        parts = []
        for bt in banks:
            unit_of = torch.full((T,), -1, dtype=torch.long, device=tokens.device)
            unit_of[bt.tokens] = bt.unit
            unit = unit_of[tokens]
            # A grouped matmul takes fewer than MAX_GROUPS (expert, adapter) groups on a GPU
            # (more fell back to a loop per group: one rank of a 128-expert model with 8
            # adapters ran 7x slower than two): the bank's adapters go in parts.
            n, per = len(bt.slots), max(1, MAX_GROUPS // E)
            for u0 in range(0, n, per):
                u1 = min(n, u0 + per)
                part = bt if u1 - u0 == n else BankTokens(bt.bank, bt.tokens, bt.unit,
                                                          bt.slots[u0:u1], bt.scale[u0:u1])
                rows = torch.nonzero((unit >= u0) & (unit < u1)).squeeze(1)
                group = experts[rows] * (u1 - u0) + unit[rows] - u0
                order = torch.argsort(group, stable=True)
                rows, group = rows[order], group[order]
                offs = torch.cumsum(torch.bincount(group, minlength=E * (u1 - u0)),
                                    0).to(torch.int32)
                scale = bt.scale[unit[rows]][:, None]
                parts.append((part, rows, scale, offs))
        return _PairAdapters(parts, owned)

    def add_deltas(self, key: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for bt, rows, scale, offs in self.parts:
            if key not in bt.bank.shapes or len(rows) == 0:
                continue
            bank, e = bt.bank, self.owned
            args = (bank.A16[key][:, e], bank.B16[key][:, e], bank.gA[key][:, e],
                    bank.gB[key][:, e], bt.slots, scale, offs)
            if torch.is_grad_enabled():
                d = _ExpertDelta.apply(x.index_select(0, rows), _anchor(x), *args)
            else:
                d = _delta(x.index_select(0, rows), *args)
            y = y.index_add(0, rows, d.to(y.dtype))
        return y


def _anchor(x: torch.Tensor) -> torch.Tensor:
    # Autograd records a Function only if an input needs grad: the bank tensors do not, so
    # this makes every delta part of the graph (as LoraBatch's anchor does).
    return torch.zeros((), device=x.device, requires_grad=True)


def _gather(W: torch.Tensor, slots: torch.Tensor, dtype) -> torch.Tensor:
    """A bank's [slots, E, a, b] -> [E * u, a, b] in (expert, adapter) group order."""
    w = W.index_select(0, slots).to(dtype)
    return w.transpose(0, 1).reshape(-1, *w.shape[2:])


def _delta(x, Aall, Ball, gA, gB, slots, scale, offs):
    A, B = _gather(Aall, slots, x.dtype), _gather(Ball, slots, x.dtype)
    return grouped_mm(grouped_mm(x, A.transpose(1, 2), offs) * scale, B.transpose(1, 2), offs)


class _ExpertDelta(torch.autograd.Function):
    """delta = scale * (x @ A[e, a]^T) @ B[e, a]^T over each (expert e, adapter a) group; the
    backward adds the gradients into the bank's buffers. The gathered weights are not kept
    for the backward (it gathers them again): held for every layer, they would cost more
    memory than the activations."""

    @staticmethod
    def forward(ctx, x, anchor, Aall, Ball, gA, gB, slots, scale, offs):
        A, B = _gather(Aall, slots, x.dtype), _gather(Ball, slots, x.dtype)
        h = grouped_mm(x, A.transpose(1, 2), offs) * scale  # [p, r]
        ctx.save_for_backward(x, h, slots, scale, offs)
        ctx.bank = (Aall, Ball, gA, gB)
        return grouped_mm(h, B.transpose(1, 2), offs)

    @staticmethod
    def backward(ctx, grad_out):
        x, h, slots, scale, offs = ctx.saved_tensors
        Aall, Ball, gA, gB = ctx.bank
        A, B = _gather(Aall, slots, x.dtype), _gather(Ball, slots, x.dtype)
        grad_out = grad_out.to(h.dtype).contiguous()
        grad_h = grouped_mm(grad_out, B, offs) * scale
        u = len(slots)
        for store, g in ((gB, grouped_weight_grad(grad_out, h, offs)),
                         (gA, grouped_weight_grad(grad_h, x, offs))):
            store.index_add_(0, slots, g.view(-1, u, *g.shape[1:]).transpose(0, 1).float())
        grad_x = grouped_mm(grad_h, A, offs) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None, None, None, None, None, None


class _ExpertMM(torch.autograd.Function):
    """x [p, in] through frozen expert weights W [E, out, in] by groups: x_g @ W[g]^T."""

    @staticmethod
    def forward(ctx, x, W, offs):
        ctx.save_for_backward(W, offs)
        return grouped_mm(x, W.transpose(1, 2), offs)

    @staticmethod
    def backward(ctx, grad_out):
        W, offs = ctx.saved_tensors
        return grouped_mm(grad_out.contiguous(), W, offs), None, None


def shard_experts(blocks: dict[int, MoeBlock], split: ExpertSplit) -> None:
    """Keep only this rank's experts of every layer (before the model goes to its device)."""
    for block in blocks.values():
        for param in block.expert_parameters():
            param.data = param.data[block.owned].clone()


def moe_blocks(model_type: str, config, layers, split: ExpertSplit | None = None
               ) -> dict[int, MoeBlock]:
    """The sparse layers of a model, checked against the layout we know; {} for a dense
    model. Anything else is refused with what we found. With `split`, each block computes
    this rank's experts only (see moe_parallel.py)."""
    if model_type not in MOE_ARCHS:
        return {}
    normalize = MOE_ARCHS[model_type]
    if normalize is None:
        normalize = bool(getattr(config, "norm_topk_prob", False))
    top_k = int(config.num_experts_per_tok)
    known = sorted(_ROUTED + (_SHARED if model_type in SHARED_EXPERT else []))
    blocks = {}
    for i, layer in enumerate(layers):
        mlp = layer.mlp
        if all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            continue  # a dense layer of an MoE model (Qwen3-MoE's mlp_only_layers)
        found = sorted(n for n, _ in mlp.named_parameters())
        if found != known:
            raise EngineInputError("model", f"layer {i}: MoE layout {found} is not supported "
                                   f"(known: {', '.join(known)})")
        E, two_i, H = mlp.experts.gate_up_proj.shape
        if (tuple(mlp.gate.weight.shape) != (E, H)
                or tuple(mlp.experts.down_proj.shape) != (E, H, two_i // 2)):
            raise EngineInputError("model", f"layer {i}: expert shapes do not match the router")
        if not 1 <= top_k <= E:
            raise EngineInputError("model", f"num_experts_per_tok {top_k} is not in 1..{E}")
        blocks[i] = MoeBlock(i, mlp, normalize, top_k, split)
    return blocks
