"""Work items and the per-model queue that keeps a model's operations in seq_id order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TRAIN = "fwdbwd"  # forward / forward_backward rows: packed with other models' rows
SAMPLE = "sample"
OPTIM = "optim"
# Everything else (optim, save, load, create) is a barrier: it runs alone for its model,
# after every earlier operation of that model has finished.


@dataclass
class Work:
    """One queued operation. `tokens` is what it costs a tenant's share."""

    id: str
    tenant: str
    kind: str
    tokens: int = 0
    model: str | None = None  # None for samples: they have no order
    seq: int | None = None
    payload: Any = None
    admitted_step: int = -1  # the step count when it entered the queue (for waiting times)
    # A train op may be cut between datums to fit a step: `parts` are its datums' tokens.
    # A piece carries lo/hi (the datums it covers) and `final` (the op's last piece).
    parts: list[int] | None = None
    taken: int = 0  # datums already planned (for an op cut into pieces)
    lo: int = 0
    hi: int | None = None
    final: bool = True

    @property
    def is_barrier(self) -> bool:
        return self.kind not in (TRAIN, SAMPLE)


@dataclass
class ModelQueue:
    """A model's operations by seq_id; only the one at `next_seq` may run (gaps wait)."""

    next_seq: int = 1
    pending: dict[int, Work] = field(default_factory=dict)
    in_flight: int = 0  # operations planned but not yet reported complete
    # Restored after a crash: the client's seq_ids ran on past the persisted state, so the
    # first op to arrive sets where the queue resumes.
    resync: bool = False

    def head(self) -> Work | None:
        """The op that may run now, or None (gap, empty, or the model is busy)."""
        if self.in_flight:
            return None
        return self.pending.get(self.next_seq)

    def run_of_train(self) -> list[Work]:
        """Consecutive forward/backward ops from the head: they may share one step."""
        if self.in_flight:
            return []
        out, seq = [], self.next_seq
        while (w := self.pending.get(seq)) is not None and w.kind == TRAIN:
            out.append(w)
            seq += 1
        return out

    def rows_behind(self, w: Work) -> bool:
        """Forward/backward ops are queued behind `w`."""
        return any(p.kind == TRAIN for seq, p in self.pending.items() if seq > w.seq)

    def take(self, w: Work) -> None:
        assert w.seq == self.next_seq, "a model's ops leave in seq_id order"
        del self.pending[w.seq]
        self.next_seq += 1
        self.in_flight += 1
