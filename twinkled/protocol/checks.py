"""The rules a request must meet before it is queued: one copy, torch-free.

The daemon's HTTP process runs them at the door (before a request takes a place in a queue,
so nothing one tenant sends can fail a step that other tenants share); twinkle_sdk's local
mode runs the same ones through `Engine.check`. Workers do not check again.

Arrays arrive as plain sequences (lists, `array.array`s, or anything with `len`, `min`,
`max` and iteration), never tensors: the HTTP process has no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from twinkled.protocol.checkpoints import (
    path_part_problem,  # the path's rule: a name must pass it too
)
from twinkled.protocol.types import OPTIMIZERS, AdamParams, DimuonParams, EngineInputError

# Loss name -> (required inputs, optional inputs, config keys, required config keys).
_RL = ("target_tokens", "logprobs", "advantages")
_CLIP = ("clip_low_threshold", "clip_high_threshold")
# stable_reinforce trains on what the sampler recorded (record_stability_info=True): the
# daemon fills these two inputs from its records of the sampled sequences that a datum's
# provenance spans name (`twinkled/core/stability.py`); a Tinker client never sends them. In
# local mode (twinkle_sdk in-process) the caller passes them directly.
RECORDED_INPUTS = ("sampler_logprobs", "sampled_mask")
LOSS_SIGNATURES: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...],
                                 tuple[str, ...]]] = {
    "cross_entropy": (("target_tokens",), ("weights",), (), ()),
    "importance_sampling": (_RL, (), (), ()),
    "ppo": (_RL, _CLIP, _CLIP, ()),
    "cispo": (_RL, _CLIP, _CLIP, ()),
    "dro": (_RL, (), ("beta",), ()),
    "gspo": ((*_RL, "sequence_ratio_mask"), _CLIP, _CLIP, ()),
    # `logprobs` (what the client got from the sampler) is accepted and not used: the
    # recorded copy is what the loss reads.
    "stable_reinforce": (("target_tokens", "advantages", *RECORDED_INPUTS), ("logprobs",),
                         ("kl_coeff",), ()),
}
# Config values that must not be negative (a negative penalty would reward moving away).
NON_NEGATIVE_CONFIG = {"beta", "kl_coeff", *_CLIP}
INT_INPUTS = {"target_tokens"}
KNOWN_INPUTS = {n for sig in LOSS_SIGNATURES.values() for n in sig[0] + sig[1]}


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the model. The model's own numbers (vocab, context)
    come from its config; the rest are the daemon's settings (`docs/reference.md`)."""

    vocab_size: int
    max_seq_len: int
    max_rank: int = 128
    max_datums: int = 4096  # datums in one forward_backward call
    max_num_samples: int = 256  # num_samples of one sampling request
    max_stop: int = 32  # stop strings in a stop list
    max_stop_ids: int = 1024  # stop token ids in a stop list (a set lookup per token)
    max_stop_chars: int = 256  # length of one stop string
    max_topk: int = 64  # k of top-k logprobs and of prompt alternative draws
    max_prompt_cells: int = 1 << 21  # prompt positions x ids scored by one request
    max_name_chars: int = 128  # checkpoint names
    max_ttl_s: int = 10 * 365 * 86400
    max_metadata_bytes: int = 65536  # user_metadata, as JSON
    # The longest sequence the sampler's KV pool holds (the workers say; 0: no bound).
    kv_tokens: int = 0


def fail(field: str, message: str) -> EngineInputError:
    return EngineInputError(field, message)


# -- forward/backward ---------------------------------------------------------------------

def check_loss(loss_fn: str, loss_config: Mapping[str, Any] | None) -> None:
    if loss_fn not in LOSS_SIGNATURES:
        raise fail("loss_fn", f"unknown loss {loss_fn!r}; built-in losses: "
                   f"{', '.join(LOSS_SIGNATURES)}")
    _, _, known, required = LOSS_SIGNATURES[loss_fn]
    cfg = loss_config or {}
    unknown = set(cfg) - set(known)
    if unknown:
        raise fail("loss_fn_config", f"{sorted(unknown)} not used by {loss_fn!r} "
                   f"(accepted: {list(known) or 'none'})")
    for k in required:
        if k not in cfg:
            raise fail(f"loss_fn_config.{k}", f"required by {loss_fn!r}")
    for k, v in cfg.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise fail(f"loss_fn_config.{k}", f"must be a finite number, got {v!r}")
        if k in NON_NEGATIVE_CONFIG and v < 0:
            raise fail(f"loss_fn_config.{k}", f"must be >= 0, got {v!r}")
    if cfg.get("clip_low_threshold", 0.0) > cfg.get("clip_high_threshold", math.inf):
        raise fail("loss_fn_config.clip_low_threshold",
                   f"{cfg['clip_low_threshold']} is above clip_high_threshold "
                   f"{cfg['clip_high_threshold']}")


def check_datum(j: int, tokens: Sequence, inputs: Mapping[str, tuple[Sequence[int], Sequence]],
                loss_fn: str | None, limits: Limits) -> None:
    """One datum: `inputs` maps a loss input's name to (shape, flat values).

    `loss_fn` None (a Python callable loss, local mode) allows any input name."""
    where = f"data[{j}]"
    n = len(tokens)
    if n == 0:
        raise fail(f"{where}.model_input", "is empty: a datum needs at least one token")
    if n > limits.max_seq_len:
        raise fail(f"{where}.model_input",
                   f"length {n} exceeds the model's context of {limits.max_seq_len}")
    check_token_ids(f"{where}.model_input", tokens, limits.vocab_size)
    if "target_tokens" not in inputs:
        raise fail(f"{where}.loss_fn_inputs.target_tokens", "required")
    for name, (shape, values) in inputs.items():
        field = f"{where}.loss_fn_inputs.{name}"
        # Inputs of other built-in losses are allowed (the same RL datums are often sent to
        # a forward pass); a name no loss knows is most likely a typo.
        if loss_fn is not None and name not in KNOWN_INPUTS:
            raise fail(field, f"unknown loss input (known: {sorted(KNOWN_INPUTS)})")
        if list(shape) != [n] and not _top_k_shape(name, shape, n, loss_fn, limits):
            raise fail(field, f"has shape {list(shape)}, but the model input has {n} tokens"
                       + (" (or [N, K] with cross_entropy)" if name in TOP_K_INPUTS else ""))
        if len(values) != math.prod(shape):
            raise fail(field, f"has {len(values)} values for shape {list(shape)}")
        if name in INT_INPUTS:
            check_token_ids(field, values, limits.vocab_size)
        else:
            check_finite(field, values)
    if loss_fn is not None:
        for name in LOSS_SIGNATURES[loss_fn][0]:
            if name not in inputs:
                raise fail(f"{where}.loss_fn_inputs.{name}", f"required by {loss_fn!r}")
        rule = _DATUM_RULES.get(loss_fn)
        if rule is not None:
            rule(f"{where}.loss_fn_inputs", {k: v for k, (_, v) in inputs.items()})
    shapes = {tuple(inputs[k][0]) for k in TOP_K_INPUTS if k in inputs}
    if len(shapes) > 1:
        raise fail(f"{where}.loss_fn_inputs.weights", "must have the shape of target_tokens")


# Top-K distillation: cross_entropy's target_tokens and weights may be [N, K] (K ids per
# position, weighted), as Tinker's cross_entropy defines.
TOP_K_INPUTS = ("target_tokens", "weights")


def _top_k_shape(name: str, shape: Sequence[int], n: int, loss_fn: str | None,
                 limits: Limits) -> bool:
    return (name in TOP_K_INPUTS and loss_fn in ("cross_entropy", None) and len(shape) == 2
            and shape[0] == n and 1 <= shape[1] <= limits.max_topk)


def _gspo_datum(where: str, inputs: Mapping[str, Sequence]) -> None:
    # The sequence ratio is a mean over the marked tokens: with none it is undefined (NaN).
    if not any(v != 0 for v in inputs["sequence_ratio_mask"]):
        raise fail(f"{where}.sequence_ratio_mask", "marks no token: gspo's sequence ratio is "
                   "the mean log-ratio over the marked tokens, so mark at least one")


def _stable_reinforce_datum(where: str, inputs: Mapping[str, Sequence]) -> None:
    mask = inputs["sampled_mask"]
    if any(v not in (0, 1) for v in mask):
        raise fail(f"{where}.sampled_mask", "must hold only 0 and 1")
    # The sampler recorded nothing about a prompt token, so no advantage can ride on one
    # (the tinker-cookbook relies on this: it refuses KL discounting onto prompt tokens).
    for i, (m, a) in enumerate(zip(mask, inputs["advantages"], strict=True)):
        if m == 0 and a != 0:
            raise fail(f"{where}.advantages", f"is {a} at position {i}, which is not a sampled "
                       "token: stable_reinforce takes advantages only on sampled tokens")


_DATUM_RULES = {"gspo": _gspo_datum, "stable_reinforce": _stable_reinforce_datum}


def check_token_ids(field: str, ids: Sequence, vocab: int) -> None:
    if not ids:
        return
    if not all(type(t) is int for t in ids):
        raise fail(field, "token ids must be integers")
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise fail(field, f"token id {bad} is outside the vocabulary (0..{vocab - 1})")


def check_finite(field: str, values: Sequence) -> None:
    try:
        # One C-speed pass: a sum of float32-range values is finite iff every value is.
        total = math.fsum(values)
    except TypeError:
        raise fail(field, "must hold numbers") from None
    except (OverflowError, ValueError):  # fsum raises on inf - inf or huge Python ints
        total = math.nan
    if not math.isfinite(total):
        raise fail(field, "contains NaN or infinite values")


# -- optimizer ------------------------------------------------------------------------

def check_adam_params(p: AdamParams) -> None:
    for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
        v = getattr(p, name)
        if not isinstance(v, (int, float)) or not math.isfinite(v):
            raise fail(f"adam_params.{name}", f"must be a finite number, got {v!r}")
    if p.learning_rate < 0:
        raise fail("adam_params.learning_rate", "must be >= 0")
    for name in ("beta1", "beta2"):
        if not 0.0 <= getattr(p, name) < 1.0:
            raise fail(f"adam_params.{name}", "must be in [0, 1)")
    if p.eps < 0 or p.weight_decay < 0 or p.grad_clip_norm < 0:
        raise fail("adam_params", "eps, weight_decay and grad_clip_norm must be >= 0")


def check_dimuon_params(p: DimuonParams) -> None:
    """The SDK's own bounds (tinker 0.38 types/optimizer.py: learning_rate >= 0, 0 <= beta1
    < 1, no inf/NaN anywhere); grad_clip_norm may be any finite number (<= 0 means off)."""
    for name in ("learning_rate", "grad_clip_norm", "beta1", "rank_lr_correction_exponent"):
        v = getattr(p, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise fail(f"optimizer_params.{name}", f"must be a finite number, got {v!r}")
    if p.learning_rate < 0:
        raise fail("optimizer_params.learning_rate", "must be >= 0")
    if not 0.0 <= p.beta1 < 1.0:
        raise fail("optimizer_params.beta1", "must be in [0, 1)")


def check_optimizer(name: str) -> None:
    """An optimizer family chosen at creation (Tinker's `optimizer_config.type`)."""
    if name not in OPTIMIZERS:
        raise fail("optimizer_config.type", f"unknown optimizer {name!r}; supported: "
                   f"{', '.join(OPTIMIZERS)}")


def check_optim_params(optimizer: str, p: AdamParams | DimuonParams) -> None:
    """One step's params: of the family the model was created with, and in range."""
    if isinstance(p, AdamParams):
        if optimizer != "adamw":
            raise fail("adam_params", f"this model was created with the {optimizer!r} "
                       "optimizer: send DimuonParams (optimizer_params), not AdamParams")
        check_adam_params(p)
    elif isinstance(p, DimuonParams):
        if optimizer != "dimuon":
            raise fail("optimizer_params", f"this model was created with the {optimizer!r} "
                       "optimizer: send AdamParams (adam_params), not DimuonParams")
        check_dimuon_params(p)
    else:
        raise fail("optimizer_params", f"expected AdamParams or DimuonParams, got "
                   f"{type(p).__name__}")



# -- sampling -----------------------------------------------------------------------------

def check_sample(prompt: Sequence, max_tokens: int, num_samples: int, stop: Any,
                 limits: Limits) -> None:
    n = len(prompt)
    if n == 0:
        raise fail("prompt", "is empty: a prompt needs at least one token")
    check_token_ids("prompt", prompt, limits.vocab_size)
    if not 1 <= num_samples <= limits.max_num_samples:
        raise fail("num_samples", f"must be in 1..{limits.max_num_samples}, got {num_samples}")
    if max_tokens < 1:
        raise fail("sampling_params.max_tokens", f"must be >= 1, got {max_tokens}")
    if n + max_tokens > limits.max_seq_len:
        raise fail("sampling_params.max_tokens", f"prompt ({n}) + max_tokens ({max_tokens}) "
                   f"exceeds the model's context of {limits.max_seq_len}")
    if limits.kv_tokens and n + max_tokens > limits.kv_tokens:
        # It would never get its pages: refused now, with the numbers, not failed later.
        raise fail("sampling_params.max_tokens", f"prompt ({n}) + max_tokens ({max_tokens}) "
                   f"= {n + max_tokens} tokens exceed the {limits.kv_tokens} tokens the "
                   "sampler's KV pool holds (sample_kv_mb)")
    check_stop(stop, limits)


def check_prompt_scores(prompt: Sequence, prompt_logprobs: bool, last_n: int | None,
                        topk_prompt: int, topk_sample: int, alt_k: int,
                        target: list[list[int]] | None, limits: Limits) -> None:
    """What a sampling request asks to know about its prompt (Tinker's SampleRequest):
    within the model and the limits, and bounded in cost (positions x ids)."""
    n = len(prompt)
    for name, k in (("topk_prompt_logprobs", topk_prompt), ("topk_sample_logprobs", topk_sample),
                    ("prompt_alt_tokens_k", alt_k)):
        if not 0 <= k <= limits.max_topk:
            raise fail(name, f"must be in 0..{limits.max_topk}, got {k}")
    for name, k in (("topk_prompt_logprobs", topk_prompt), ("prompt_alt_tokens_k", alt_k)):
        if n * k > limits.max_prompt_cells:
            raise fail(name, f"{n} prompt tokens x {k} is over the limit of "
                       f"{limits.max_prompt_cells} scored cells")
    if last_n is not None:
        if not prompt_logprobs:
            raise fail("prompt_logprobs_last_n", "applies to prompt logprobs: set "
                       "prompt_logprobs (include_prompt_logprobs)")
        if not 1 <= last_n <= n - 1:
            raise fail("prompt_logprobs_last_n", f"must be in 1..len(prompt) - 1 = {n - 1}, "
                       f"got {last_n}")
    if target is None:
        return
    where = "target_prompt_logprobs"
    if len(target) != n - 1:
        raise fail(where, f"needs exactly len(prompt) - 1 = {n - 1} rows, got {len(target)}")
    ids = {t for row in target for t in row if t != -1}
    if not ids:
        raise fail(where, "names no token id (every cell is -1)")
    if n * len(ids) > limits.max_prompt_cells:
        raise fail(where, f"{n} prompt tokens x {len(ids)} distinct ids is over the limit of "
                   f"{limits.max_prompt_cells} scored cells")
    bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise fail(where, f"token id {bad} is outside the vocabulary (0..{limits.vocab_size - 1}"
                   ", or -1 for nothing)")


def check_knobs(temperature: float, top_p: float, top_k: int) -> None:
    if not 0 <= temperature < math.inf:
        raise fail("sampling_params.temperature", "must be a finite number >= 0")
    if not 0 < top_p <= 1:
        raise fail("sampling_params.top_p", "must be in (0, 1]")
    if type(top_k) is not int or (top_k < 1 and top_k != -1):
        raise fail("sampling_params.top_k", "must be -1 (off) or >= 1")


def check_stop(stop: Any, limits: Limits) -> None:
    """None (EOS), [] (never stop early), all strings, or all token ids.

    Token ids are checked with a set lookup per generated token (choose.stop_reason), so a
    request may stop on a whole class of tokens (max_stop_ids); strings are matched against
    the decoded tail at every token, so their count stays tighter (max_stop)."""
    if stop is None:
        return
    field = "sampling_params.stop"
    if not isinstance(stop, list):
        raise fail(field, "must be a list of strings or of token ids")
    if not stop:
        return
    kind = type(stop[0])
    if kind not in (str, int):
        raise fail(field, "must be all strings or all token ids (integers)")
    limit, key, what = ((limits.max_stop, "max_stop", "stop strings") if kind is str else
                        (limits.max_stop_ids, "max_stop_ids", "stop token ids"))
    if len(stop) > limit:  # before anything walks the list
        raise fail(field, f"has {len(stop)} {what}; at most {limit} ({key})")
    if any(type(s) is not kind for s in stop):
        raise fail(field, "must be all strings or all token ids (integers)")
    if kind is str:
        if any(not s or len(s) > limits.max_stop_chars for s in stop):
            raise fail(field, f"stop strings must have 1..{limits.max_stop_chars} characters")
        return
    check_token_ids(field, stop, limits.vocab_size)


# -- names and records --------------------------------------------------------------------

_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-:+=@,")


def check_name(field: str, name: str, limits: Limits) -> None:
    """A checkpoint name becomes a directory name: short, and plain characters only."""
    if not isinstance(name, str) or not name:
        raise fail(field, "must be a non-empty string")
    if len(name) > limits.max_name_chars:
        raise fail(field, f"is {len(name)} characters long; at most {limits.max_name_chars}")
    if name[0] in ".-" or not set(name) <= _NAME_CHARS or path_part_problem(name):
        raise fail(field, f"{name!r} is not a valid name: use letters, digits and . _ - : + = "
                   "@ , (not starting with '.' or '-'; no '/' and no '..')")


def check_ttl(field: str, ttl: int | None, limits: Limits) -> None:
    if ttl is not None and not 1 <= ttl <= limits.max_ttl_s:
        raise fail(field, f"must be in 1..{limits.max_ttl_s} seconds (max_ttl_s) or null, "
                   f"got {ttl}")


def check_metadata_size(field: str, encoded: bytes, limits: Limits) -> None:
    if len(encoded) > limits.max_metadata_bytes:
        raise fail(field, f"is {len(encoded)} bytes as JSON; at most "
                   f"{limits.max_metadata_bytes} (max_metadata_bytes)")


def check_rank(rank: int, limits: Limits) -> None:
    if not 1 <= rank <= limits.max_rank:
        raise fail("lora_config.rank", f"must be in 1..{limits.max_rank}, got {rank}")
