"""Provenance spans of a Datum (SDK 0.38's `Datum.with_provenance`) as the codec reads them:
runs that tile the model input or the targets, each naming a sampled sequence. Only their
shape is checked here; `twinkled/core/stability.py` checks what they claim."""

from __future__ import annotations

from typing import Any

import msgspec


class SpanError(ValueError):
    """A malformed span (the codec answers it as a CodecError: a 400)."""


# An offset or length past this cannot be real (a datum's tensors hold at most 2**22 values).
MAX_SPAN_VALUE = 1 << 22


class SpanIn(msgspec.Struct, frozen=True):
    """A provenance run (`twinkled.core.stability.Span`): kind "prompt" or "sampled"."""

    kind: str
    sequence_id: str
    offset: int
    length: int


_SPAN_KINDS = {"prompt_tokens": "prompt", "sampled_tokens": "sampled"}
MAX_SEQUENCE_ID_CHARS = 256


def decode_spans(spans: Any, where: str) -> list[SpanIn] | None:
    if not spans:
        return None
    if len(spans) > MAX_SPAN_VALUE:
        raise SpanError(f"{where}: {len(spans)} spans; at most {MAX_SPAN_VALUE}")
    out = []
    for k, span in enumerate(spans):
        arm = span.WhichOneof("span")
        if arm not in _SPAN_KINDS:
            raise SpanError(f"{where}[{k}]: empty or unrecognised provenance span")
        run = getattr(span, arm)
        if not 0 < len(run.sequence_id) <= MAX_SEQUENCE_ID_CHARS:
            raise SpanError(f"{where}[{k}].sequence_id: must have 1..{MAX_SEQUENCE_ID_CHARS} "
                            "characters")
        if not 0 <= run.offset <= MAX_SPAN_VALUE or not 0 <= run.length <= MAX_SPAN_VALUE:
            raise SpanError(f"{where}[{k}]: offset {run.offset} and length {run.length} must be "
                            f"in 0..{MAX_SPAN_VALUE}")
        out.append(SpanIn(_SPAN_KINDS[arm], run.sequence_id, run.offset, run.length))
    return out
