"""RoPE scalings a row longer than the model's config may use (engine/long_context.py),
checked in config files before anything loads (protocol/config.py)."""

from __future__ import annotations

# Not "dynamic" (NTK): it rotates a position by the length of the pass that holds it, so a
# sampled token would be rotated otherwise than the same token in training.
ROPE_SCALINGS = ("yarn", "linear", "llama3", "longrope")
RULE = (f"must be {{}} or a table of rope_type (one of {', '.join(ROPE_SCALINGS)}) and "
        "factor >= 1 (and original_max_position_embeddings)")


def rope_scaling_ok(v: dict) -> bool:
    """{} (none), or a known rope_type (or its old name "type") with a factor >= 1."""
    kind, factor = v.get("rope_type") or v.get("type"), v.get("factor")
    return not v or (kind in ROPE_SCALINGS and isinstance(factor, (int, float)) and factor >= 1)
