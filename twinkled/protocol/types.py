"""Plain data types the engine takes and returns.

They may carry torch tensors and Python callables, so they are dataclasses, not wire
structs; the optimizer params are the exception (tagged msgspec structs: an optim op carries
either family's, and a union of two types needs a tag). This module does not import torch: the daemon's HTTP process builds requests from
them, and `twinkled.protocol.frames` turns them into msgspec frames for the workers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    import torch

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
# A linear-attention layer's linears (Qwen3.5's Gated DeltaNet, qwen35.py; Qwen3-Next's
# fuses its input projections as in_proj_qkvz and in_proj_ba): `train_attn` adapts them as
# it does q/k/v/o.
LINEAR_ATTN_MODULES = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz",
                       "in_proj_ba", "out_proj")
# Multi-head latent attention's own linears (DeepSeek-V3, engine/mla.py), besides q/o_proj.
MLA_MODULES = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)
# An MoE layer's expert parameters (moe.py); `train_mlp` adapts them as it does a dense MLP.
EXPERT_MODULES = ("gate_up_proj", "down_proj")
# Tinker's optimizer families (`optimizer_config.type`), fixed when an adapter is created.
OPTIMIZERS = ("adamw", "dimuon")


class EngineInputError(ValueError):
    """A request the engine refuses before touching any state. `field` names what is wrong."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class LoraConfig:
    """Tinker's LoraConfig plus what Tinker leaves implicit (alpha; 32 is Tinker's default)."""

    rank: int = 32
    alpha: float = 32.0
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    # The optimizer family: part of the adapter from its creation, as in Tinker (an
    # optim_step's params must match it); kept with its live state and checkpoints.
    optimizer: str = "adamw"

    @property
    def target_modules(self) -> tuple[str, ...]:
        return (
            (ATTN_MODULES + LINEAR_ATTN_MODULES + MLA_MODULES if self.train_attn else ())
            + (MLP_MODULES if self.train_mlp else ())
            + (UNEMBED_MODULES if self.train_unembed else ())
        )

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class AdamParams(msgspec.Struct, tag_field="type", tag="adamw"):
    """Tinker's AdamParams, with its defaults. May change at every step."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class DimuonParams(msgspec.Struct, tag_field="type", tag="dimuon"):
    """Tinker's DimuonParams (SDK 0.38: learning_rate, grad_clip_norm, beta1), one step's.

    What the fields mean, and where that is written (`engine/dimuon.py` has the rule):
    - learning_rate (>= 0, no default in the SDK): applied to "a direction with Frobenius
      norm sqrt(rank), with rank correction applied uniformly to all LoRA matrices"
      (tinker-docs.thinkingmachines.ai, api-reference/types/dimuonparams);
    - grad_clip_norm: "Maximum global gradient norm. Nonpositive values disable gradient
      clipping" (SDK 0.38 tinker/types/optimizer.py); so a negative value is valid: off;
    - beta1 in [0, 1): "EMA coefficient for the momentum" (same file);
    - rank_lr_correction_exponent: not in SDK 0.38; the docs' newer DimuonParams has it,
      default 0.175, "relative to rank 32. Zero disables rank correction".
    """

    learning_rate: float
    grad_clip_norm: float = 0.0
    beta1: float = 0.9
    rank_lr_correction_exponent: float = 0.175


OptimParams = AdamParams | DimuonParams


# A custom loss gets the request's data and one logprob tensor per datum (with grad) and
# returns (scalar loss, metrics), as Tinker's forward_backward_custom does.
CustomLoss = Callable[[list["Datum"], list["torch.Tensor"]], tuple["torch.Tensor", dict[str, float]]]


@dataclass
class Datum:
    """One sequence: `tokens` is the model input; each loss input has the same length N.

    Position i of the input predicts `loss_inputs["target_tokens"][i]`.
    """

    tokens: list[int] | torch.Tensor
    loss_inputs: dict[str, torch.Tensor | list] = field(default_factory=dict)
    # A VL model's images (protocol/images.PreparedImage), in the order of their
    # placeholder runs in `tokens`; their positions carry no targets (weights 0).
    images: list = field(default_factory=list)


@dataclass
class ForwardBackwardRequest:
    """One call of one adapter (None = the base model, forward only)."""

    adapter_id: str | None
    data: list[Datum]
    loss_fn: str | CustomLoss = "cross_entropy"
    loss_config: dict[str, float] = field(default_factory=dict)
    forward_only: bool = False


@dataclass
class ForwardBackwardResult:
    outputs: list[dict[str, torch.Tensor]]  # per datum: logprobs, elementwise_loss
    metrics: dict[str, float]


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    # None: stop at EOS only. []: never stop early, EOS included (Tinker semantics).
    stop: list[str] | list[int] | None = None

    @cached_property
    def stop_ids(self) -> frozenset[int]:
        """The stop token ids as a set (empty for strings or EOS): a row checks its every
        new token against it, in O(1) however many ids (up to max_stop_ids) it holds."""
        stop = self.stop or []
        return frozenset(stop) if stop and isinstance(stop[0], int) else frozenset()


@dataclass
class SampleRequest:
    adapter_id: str | None
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    num_samples: int = 1
    prompt_logprobs: bool = False
    # What else to score, as Tinker's SampleRequest defines it. Prompt row i (of n - 1) is
    # the distribution over prompt token i + 1 (token 0 has no context).
    prompt_last_n: int | None = None  # score only the last n prompt tokens (and top-k rows)
    topk_prompt: int = 0  # top-k (id, logprob) at every scored prompt position
    topk_sample: int = 0  # top-k (id, logprob) at every sampled position
    target_prompt: list[list[int]] | None = None  # [n - 1, K] ids to score; -1: none
    alt_tokens_k: int = 0  # k draws at the request's temperature per prompt row
    # A VL model's images (protocol/images.PreparedImage), in the order of their
    # placeholder runs in `prompt` (engine/vision_prefill.py).
    images: tuple = ()


# Top-k rows: (token ids, logprobs) per position; an empty row was not scored.
TopK = tuple[list[list[int]], list[list[float]]]


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" or "length"
    topk: TopK | None = None  # one row per sampled token (topk_sample)


@dataclass
class SampleResult:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt: TopK | None = None  # one row per prompt token (row 0 empty)
    target_prompt: list[list[float]] | None = None  # as target_prompt; 0.0 where -1
    alt_tokens: tuple[list[list[int]], list[list[float]]] | None = None  # [n - 1, k] each
    # Prompt tokens whose keys and values came from the sampler's prefix cache (not prefilled
    # for this request); counted once per request, whatever its num_samples.
    cached_tokens: int = 0


@dataclass
class LogprobGap:
    """A sampled sequence's logprobs from the sampler against the trainer's forward of
    the same tokens: mean and max |difference| per generated token (nats), over `tokens`."""

    mean: float
    max: float
    tokens: int


@dataclass
class AdapterInfo:
    adapter_id: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    steps: int
    pending: int
    optimizer: str = "adamw"


@dataclass
class OptimResult:
    applied: bool
    metrics: dict[str, Any]
