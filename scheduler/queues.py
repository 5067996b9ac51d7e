"""Work items and the per-model queue that keeps a model's operations in seq_id order."""

from __future__ import annotations

from collections.abc import ItemsView, ValuesView
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


class ModelQueues:
    """The open models' queues: whose each model is, which seq_id it waits for, and what it
    has queued or running. What the daemon asks about a model's ops (seq_id checks,
    residency, gathering a client's pipelined optim_step) is answered here; the planner
    decides from the same queues what runs next."""

    def __init__(self) -> None:
        self._queues: dict[str, ModelQueue] = {}
        self._tenant: dict[str, str] = {}

    def open(self, model: str, tenant: str, next_seq: int = 1, resync: bool = False) -> None:
        self._queues[model] = ModelQueue(next_seq=next_seq, resync=resync)
        self._tenant[model] = tenant

    def forget(self, model: str) -> None:
        """Drop `model` if nothing of it is queued or running."""
        q = self._queues.get(model)
        if q is not None and not q.pending and not q.in_flight:
            del self._queues[model]
            self._tenant.pop(model, None)

    def __contains__(self, model: str) -> bool:
        return model in self._queues

    def __getitem__(self, model: str) -> ModelQueue:
        return self._queues[model]

    def items(self) -> ItemsView[str, ModelQueue]:
        return self._queues.items()

    def values(self) -> ValuesView[ModelQueue]:
        return self._queues.values()

    def tenant_of(self, model: str) -> str | None:
        return self._tenant.get(model)

    def models_of(self, tenant: str) -> list[str]:
        """The open models of `tenant`."""
        return [m for m, t in self._tenant.items() if t == tenant]

    def count(self, tenant: str | None = None) -> int:
        """How many models are open (of `tenant`, if given)."""
        if tenant is None:
            return len(self._queues)
        return sum(t == tenant for t in self._tenant.values())

    def seqs(self) -> dict[str, int]:
        """{model: the seq_id it waits for}, of every open model."""
        return {m: q.next_seq for m, q in self._queues.items()}

    def next_seq(self, model: str) -> int | None:
        """The seq_id the model waits for (None: no such model)."""
        q = self._queues.get(model)
        return None if q is None else q.next_seq

    def seq_taken(self, model: str, seq: int) -> bool:
        """`seq` of `model` already ran or is queued."""
        q = self._queues[model]
        return seq < q.next_seq or seq in q.pending

    def resyncing(self, model: str) -> bool:
        """The model resumes at whatever seq_id arrives first (restored after a crash)."""
        return self._queues[model].resync

    def has_pending(self, model: str) -> bool:
        q = self._queues.get(model)
        return q is not None and bool(q.pending)

    def awaits_barrier(self, model: str) -> bool:
        """The model's last queued op is a forward/backward: a client that sends an
        optim_step right behind each one has not sent it yet."""
        q = self._queues.get(model)
        if q is None or not q.pending:
            return False
        return not q.pending[max(q.pending)].is_barrier

    def with_work(self) -> int:
        """How many models have ops queued."""
        return sum(1 for q in self._queues.values() if q.pending)

    def busy(self, model: str) -> bool:
        """Something of the model is queued or running."""
        q = self._queues.get(model)
        return q is not None and bool(q.pending or q.in_flight)

    def seq_after_queued(self, model: str) -> int:
        """The first seq_id after everything the model ran or has queued."""
        q = self._queues[model]
        return max([q.next_seq - 1, *q.pending]) + 1
