"""The built-in tiny model the cookbook trains (built offline, once, in about a second)."""

from __future__ import annotations

import os
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"


def tiny_model(kind: str = "sft") -> str:
    """A tiny Qwen3-shaped model with random weights and a small BPE tokenizer.

    `kind="rl"` spreads the next-token distribution (embedding std 0.02), so sampled
    completions differ and rewards have something to rank; "sft" keeps the peaked default."""
    from twinkled.engine.tiny import build_tiny_model

    root = Path(os.environ.get("TWINKLE_CACHE", Path.home() / ".cache" / "twinkle"))
    out = root / f"cookbook-tiny-{kind}"
    if not (out / "config.json").is_file():
        build_tiny_model(out, embed_std=0.02 if kind == "rl" else 0.2)
    return str(out)


if __name__ == "__main__":  # python cookbook/tiny.py [sft|rl]: build it, print its directory
    import sys

    print(tiny_model(sys.argv[1] if len(sys.argv) > 1 else "sft"))
