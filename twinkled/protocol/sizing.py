"""What a base model needs on each rank: whether it splits over a tensor-parallel group,
and how many bytes its weights, adapters and a training step's activations take.

Plain arithmetic on the model's config.json (a dict), no torch: the daemon checks a
layout with it before any worker starts (twinkled/server/layout.py), and the engine uses it to
decide per micro-batch whether to recompute activations (model.py).

The activation figure is per token per decoder layer: about 14 hidden-widths (norms in
fp32, q/k/v, rotary temporaries, attention out) and 4 MLP-widths (gate, up, act, product)
in the compute dtype, calibrated on Qwen3-8B at 4096 tokens (57.5 GiB measured peak,
BENCHMARKS.md); under tensor parallelism the attention and MLP parts are split, the
norms are not. The log-softmax over the vocabulary adds two fp32 logit tensors. The
embedding and lm_head are split over the vocabulary when tp divides it (tp.py), and so are
the logits.
"""

from __future__ import annotations

import math

GiB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The sampler's KV pool on a lane a full-parameter run holds, at most (the engine makes the
# pool at the first sample, not at start: engine.py caps it at this while a full run
# lives). The configured pool (`sample_kv_mb`, by default 30% of what a card has left) is
# sized for many LoRA tenants' RL batches; a full run's own samples need far less, and
# its state (8+ bytes a parameter) needs the room.
FULL_RUN_KV_BYTES = 4 * GiB


def _dims(cfg: dict) -> tuple[int, int, int, int, int, int, int]:
    h = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    d = int(cfg.get("head_dim") or h // heads)
    return (h, heads, kv, d, _mlp_width(cfg), int(cfg["num_hidden_layers"]),
            int(cfg["vocab_size"]))


def _mlp_width(cfg: dict) -> int:
    """The MLP width a token runs through: `intermediate_size`, or where a sparse model has
    none (Qwen3.5-MoE) its k experts' and its shared expert's."""
    if cfg.get("intermediate_size"):
        return int(cfg["intermediate_size"])
    return (int(cfg.get("num_experts_per_tok") or 1) * int(cfg["moe_intermediate_size"])
            + int(cfg.get("shared_expert_intermediate_size") or 0))


def _mlp_params(cfg: dict, h: int, inter: int, tp: int) -> int:
    """One layer's MLP weights on a rank: a dense MLP split over tp, or every expert (split
    over tp, as tp.py splits them) plus a shared expert and the router."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if not experts:
        return 3 * h * inter // tp
    width = int(cfg.get("moe_intermediate_size") or inter)
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    return 3 * h * width * experts // tp + 3 * h * shared + h * experts


def _mlp_lora(cfg: dict, h: int, inter: int, tp: int) -> int:
    """One layer's MLP LoRA parameters per unit of rank: a dense MLP's three linears, or a
    pair on every expert (the banks keep every expert on every rank) and a shared expert's."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if not experts:
        return (h + inter // tp) * 3
    width = int(cfg.get("moe_intermediate_size") or inter)
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    return experts * (2 * h + 3 * width) + ((h + shared) * 3 if shared else 0)


def _vocab(vocab: int, tp: int) -> int:
    """The vocabulary rows one rank holds (tp.py splits them when tp divides them)."""
    return vocab // tp if vocab % tp == 0 else vocab


def split_problem(cfg: dict, tp: int) -> str | None:
    """Why the model cannot be split over `tp` ranks (None: it can)."""
    _, heads, kv, _, inter, _, _ = _dims(cfg)
    if "linear_attention" in (cfg.get("layer_types") or ()):  # Qwen3.5 (engine/tp_linear.py)
        nk, nv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
        if nk % tp or nv % tp:
            return (f"tp {tp} does not divide the model's {nk} linear-attention key heads "
                    f"and {nv} value heads")
    if heads % tp:
        return f"tp {tp} does not divide the model's {heads} attention heads"
    if kv % tp and tp % kv:
        return f"tp {tp} and the model's {kv} KV heads: one must divide the other"
    if inter % tp:
        return f"tp {tp} does not divide the model's MLP width {inter}"
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts")
                  or cfg.get("n_routed_experts") or 0)
    if experts % tp:
        return f"tp {tp} does not divide the model's {experts} experts"
    shared = int(cfg.get("moe_intermediate_size") or 0) * int(cfg.get("n_shared_experts") or 0)
    if shared % tp:  # DeepSeek's shared experts: a dense MLP, split as one
        return f"tp {tp} does not divide the width {shared} of the model's shared experts"
    return None


def weight_bytes(cfg: dict, dtype_bytes: int, tp: int = 1) -> int:
    """The base weights one rank holds."""
    h, heads, kv, d, inter, layers, vocab = _dims(cfg)
    kv_local = max(1, kv // tp)
    attn = h * d * (2 * heads // tp + 2 * kv_local)
    mlp = _mlp_params(cfg, h, inter, tp)
    embed = _vocab(vocab, tp) * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return dtype_bytes * (layers * (attn + mlp + 2 * h) + embed + h)


def lora_bytes(cfg: dict, rank: int, adapters: int, tp: int = 1) -> int:
    """Adapters of `rank` on every module: fp32 weights, gradients and two AdamW moments."""
    h, heads, kv, d, inter, layers, vocab = _dims(cfg)
    per_layer = (h + heads * d // tp) * 2 + (h + kv * d // tp) * 2 + (h + inter // tp) * 3
    return 16 * rank * adapters * (layers * per_layer + h + _vocab(vocab, tp))


# Logits of a pass beyond this many bytes (compute dtype) run the chunked head (engine/
# chunked_logprobs.py), which never holds [tokens, vocab]; below it the whole logits are kept.
FULL_LOGITS_MAX = 2 * 2**30


def activation_bytes(cfg: dict, dtype_bytes: int, tokens: int, tp: int = 1,
                     recompute: bool = False, chunked_head: bool = True) -> int:
    """A training micro-batch of `tokens`: what its backward keeps, plus the logits (8
    bytes a logit: the compute-dtype logits, their fp32 log-softmax and gradient). With
    the chunked head (a LoRA pass at tp 1) the logits held are at most the whole-logits
    path's at its switch point, FULL_LOGITS_MAX: counting every logit of a 16K-token
    micro-batch of gpt-oss-20b's 201K vocabulary (26 GiB) left its bank room for 7 of 8
    tenants' adapters, and they thrashed (BENCHMARKS.md row 40)."""
    h, _, _, _, inter, layers, vocab = _dims(cfg)
    layer = dtype_bytes * tokens * (8 * h + (6 * h + 4 * inter) // tp)
    kept = layers * dtype_bytes * tokens * h + layer if recompute else layers * layer
    logits = tokens * _vocab(vocab, tp)
    if chunked_head and tp == 1:  # (a vocabulary split keeps its whole-logits path: tp.py)
        logits = min(logits, FULL_LOGITS_MAX // dtype_bytes)
    return kept + 2 * 4 * logits


def step_bytes(cfg: dict, dtype_bytes: int, tokens: int, tp: int = 1,
               recompute: bool = False, rank: int = 32, adapters: int = 8) -> int:
    """Weights + adapters + one micro-batch's activations on one rank."""
    return (weight_bytes(cfg, dtype_bytes, tp) + lora_bytes(cfg, rank, adapters, tp)
            + activation_bytes(cfg, dtype_bytes, tokens, tp, recompute))


def adapter_bytes(cfg: dict, rank: int, attn: bool = True, mlp: bool = True,
                  unembed: bool = True, tp: int = 1) -> int:
    """One adapter on one rank: fp32 weights, gradients and two AdamW moments, the
    compute-dtype copy the passes read and the compute-dtype gradient scratch a backward
    adds to (20 bytes a parameter: engine/lora_bank.py), for the modules it trains.
    An MoE model's MLP adapter covers every expert (experts replace the dense MLP)."""
    h, heads, kv, d, inter, layers, vocab = _dims(cfg)
    per_layer = 0
    if attn:
        per_layer += (h + heads * d // tp) * 2 + (h + kv * d // tp) * 2
    if mlp:
        per_layer += _mlp_lora(cfg, h, inter, tp)
    return 20 * rank * (layers * per_layer + ((h + _vocab(vocab, tp)) if unembed else 0))


def adapter_budget(cfg: dict, card: int, dtype_bytes: int, tokens: int, tp: int = 1,
                   sampler_bytes: int = 0, headroom: float = 0.92,
                   chunked_head: bool = True) -> int:
    """What one rank of `card` bytes has for adapters once the base weights, a training
    micro-batch of `tokens` (recomputed: the least a step takes) and the sampler's KV pool
    are counted, with `headroom` of the card usable."""
    taken = (weight_bytes(cfg, dtype_bytes, tp)
             + activation_bytes(cfg, dtype_bytes, tokens, tp, recompute=True,
                                chunked_head=chunked_head) + sampler_bytes)
    return max(0, int(headroom * card) - taken)


def full_run_bytes(cfg: dict, dtype_bytes: int, ranks: int = 1) -> int:
    """A full-parameter run's state on one of its lane's `ranks`, beyond the base weights
    the lane holds already (they are its compute weights): gradients in the compute dtype,
    and its share of the fp32 masters (none apart in fp32) and two fp32 AdamW moments
    (split over the ranks: engine/full_param.py). On one rank in bf16: 14 bytes a
    parameter, 16 with the weights."""
    params = weight_bytes(cfg, 1)
    return int(params * (dtype_bytes + ((0 if dtype_bytes == 4 else 4) + 8) / ranks))


def full_run_problem(cfg: dict, dtype_bytes: int, budget: int | None,
                     ranks: int = 1) -> str | None:
    """Why a full-parameter run of this model does not fit a lane of `ranks` with `budget`
    bytes left on each after the base weights and a micro-batch (None: it fits, or there is
    no limit); the message says what would."""
    need = full_run_bytes(cfg, dtype_bytes, ranks)
    if budget is None or need <= budget:
        return None
    params = weight_bytes(cfg, 1)
    per = need / params
    split = (12 if dtype_bytes != 4 else 8) / (budget / params - dtype_bytes) \
        if budget > params * dtype_bytes else None
    more = "" if split is None else \
        f", or a lane of {max(ranks + 1, math.ceil(split))} GPUs (the state is split over them)"
    return (f"a full-parameter run of this model ({params / 1e9:.2f}B parameters) needs about "
            f"{human_size(need)} on each of this lane's {ranks} GPU(s) beyond its weights "
            f"(gradients, and its share of the fp32 master weights and AdamW moments: "
            f"{per:.0f} bytes a parameter), and each has {human_size(budget)} left for it: a "
            f"model of at most {budget / per / 1e9:.2f}B parameters would fit{more}")


def human_size(n: int | float) -> str:
    """Bytes for a person: 512 B, 1.5 KiB, 50.0 GiB."""
    value, unit = float(n), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{int(n)} B" if unit == "B" else f"{value:.1f} {unit}"
