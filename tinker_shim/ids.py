"""Id and path schemes of the Tinker API, and the validation of names that go into paths."""

from __future__ import annotations

from twinkled.protocol.checkpoints import CHECKPOINT_TYPES

# Every checkpoint kind: listed, deleted, published and given a TTL alike (REST routes).
ALL_KINDS = CHECKPOINT_TYPES
# The kinds a training client or a sampler loads from. External weights are an export (the
# PEFT files, for download); they are not loaded back.
KINDS = {k: v for k, v in CHECKPOINT_TYPES.items() if k != "external_weights"}


def valid_name(name: str) -> bool:
    """A checkpoint name becomes a path component: no '/', no '..', nothing empty."""
    return bool(name) and "/" not in name and name not in (".", "..") and "\0" not in name


def parse_checkpoint_path(path: str, kinds: dict[str, str] = KINDS) -> tuple[str, str, str]:
    """'tinker://<run>/<kind>/<name>' -> (run, kind, name); twinkle:// is accepted too."""
    for scheme in ("tinker://", "twinkle://"):
        if isinstance(path, str) and path.startswith(scheme):
            parts = path[len(scheme):].split("/")
            if len(parts) == 3 and parts[1] in kinds and valid_name(parts[2]) and parts[0]:
                return parts[0], parts[1], parts[2]
    raise ValueError(f"{path!r} is not a checkpoint path (tinker://<run_id>/<kind>/<name>, "
                     f"kind one of {sorted(kinds)})")
