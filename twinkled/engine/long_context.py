"""Rows longer than the model's config: RoPE scaling (issue 38).

A model's config.json bounds its positions (`max_position_embeddings`: 40,960 on Qwen3-8B).
The Llama family stretches that with a RoPE scaling its model card documents (Qwen3: YaRN,
`{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}`).
We only rewrite the config before the model is built: transformers' own rope init
functions (`ROPE_INIT_FUNCTIONS`) then compute the scaled inverse frequencies and the
attention factor into the rotary module's cos/sin, and every path that rotates (training's
forward, the sampler's prefill and decode, the fused rope kernel) reads those cos/sin from
it. So training and sampling rotate alike, and equal transformers' own forward
(tests/test_long_context.py).
"""

from __future__ import annotations

from twinkled.protocol.rope import ROPE_SCALINGS as SCALINGS
from twinkled.protocol.types import EngineInputError


def extend_context(config, rope_scaling: dict | None = None,
                   max_seq_len: int | None = None) -> int:
    """Apply `rope_scaling` to the Hugging Face `config` in place, and return the longest
    row the model then takes.

    `rope_scaling`: {"rope_type" (or "type"): yarn | linear | llama3 | longrope, "factor",
    "original_max_position_embeddings" (default: the config's max_position_embeddings), ...}
    as the model card gives it. `max_seq_len`: the longest row; above the config's
    positions and without `rope_scaling`, YaRN with factor max_seq_len / positions (the
    Qwen3 card's recipe); at or below them it only lowers the bound.
    """
    positions = int(config.max_position_embeddings)
    if max_seq_len is not None and max_seq_len <= 0:
        raise EngineInputError("max_seq_len", f"must be positive, got {max_seq_len}")
    current = dict(getattr(config, "rope_parameters", None) or {})
    if not rope_scaling and max_seq_len is not None and max_seq_len > positions:
        if current.get("rope_type", "default") != "default":
            raise EngineInputError(
                "max_seq_len", f"{max_seq_len} is beyond the {positions} positions of a model "
                f"whose config already scales its RoPE ({current.get('rope_type')}); "
                "give rope_scaling explicitly")
        rope_scaling = {"rope_type": "yarn", "factor": max_seq_len / positions}
    if rope_scaling:
        scaling = dict(rope_scaling)
        kind = scaling.pop("type", None) or scaling.get("rope_type")
        if kind not in SCALINGS:
            raise EngineInputError(
                "rope_scaling", f"rope_type must be one of {', '.join(SCALINGS)}, got {kind!r}")
        factor = scaling.get("factor")
        if not isinstance(factor, (int, float)) or factor < 1:
            raise EngineInputError("rope_scaling", f"factor must be a number >= 1, got {factor!r}")
        original = int(scaling.get("original_max_position_embeddings") or positions)
        scaling.update(rope_type=kind, original_max_position_embeddings=original)
        # Keep rope_theta (and anything else of the config's rope) under the new scaling.
        current = {k: v for k, v in current.items() if k in ("rope_theta", "partial_rotary_factor")}
        config.rope_parameters = {**current, **scaling}
        config.max_position_embeddings = int(original * factor)
        try:
            config.standardize_rope_params()
            config.validate_rope()
        except (KeyError, ValueError, TypeError) as e:
            raise EngineInputError("rope_scaling", f"transformers refuses {rope_scaling}: {e}") from e
    longest = int(config.max_position_embeddings)
    if max_seq_len is not None and max_seq_len > longest:
        raise EngineInputError(
            "max_seq_len", f"{max_seq_len} exceeds the {longest} positions rope_scaling "
            f"{rope_scaling} gives")
    return max_seq_len or longest
