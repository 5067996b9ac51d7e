"""What the engine core queues and what comes back: one `Op` per request a client made, and
one `Outcome` per op a step ran. Shared by the core's parts (engine core, pieces, pending
samples, executor, service), so none of them imports another for its types.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from twinkled.core.futures import Future
from twinkled.protocol.frames import OpF, kind_of

# (result, error message or None, error category or None) of one op
Outcome = tuple[object, str | None, str | None]


class Skip(msgspec.Struct, tag="skip"):
    """A request refused at the door, queued only to take its seq_id: its client hears why."""

    why: str


# What a finished op's result is handed to, with its error message (None if it ran): the
# store's side of a save, for instance.
After = Callable[[Any, str | None], None]


@dataclass
class Op:
    """One queued operation of a model (or of a sampler: seq_id None, no ordering). `frame`
    is the typed message the workers run (workers/frames.py), built and checked at the door."""

    model_id: str | None
    seq_id: int | None
    frame: OpF | Skip
    future: Future
    tokens: int = 0  # what it costs its tenant's share (rows' tokens; 0 for barriers)
    parts: list[int] | None = None  # a forward_backward's datum sizes: where it may be cut
    after: After | None = None
    piece: tuple[int, bool] | None = None  # (first datum, last piece?) of a cut op
    stream: Callable[[list], None] | None = None  # a streamed sample's reader: new tokens
    submitted: float = field(default_factory=time.monotonic)  # for the queue-wait metric

    @property
    def kind(self) -> str:
        return kind_of(self.frame)
