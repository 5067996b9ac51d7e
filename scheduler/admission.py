"""Quotas: work over its tenant's quota is held back ("paused", and its client told so), not
failed, and admitted in arrival order as the tenant's queue drains.

One exception keeps a model from stalling: the op a model waits for (its next seq_id) is
never held, since holding it could stall the model's queued ops behind it forever while they
keep the quota full. The planner (planner.py) says which op that is (`fills_gap`) and queues
what is admitted (`enqueue`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from .fairness import Fairness
from .queues import SAMPLE, Work


class Admission:
    def __init__(self, fair: Fairness):
        self._fair = fair
        self._held: dict[str, deque[Work]] = {}  # tenant -> work over its quota, FIFO
        self.paused: set[str] = set()  # ids of held work

    def over_quota(self, tenant: str, tokens: int) -> bool:
        """One more request of `tokens` would take `tenant` over its queued quota."""
        t = self._fair.tenant(tenant)
        lim = t.limits
        return ((lim.max_queued_requests is not None
                 and t.queued_requests + 1 > lim.max_queued_requests)
                or (lim.max_queued_tokens is not None and t.queued_requests > 0
                    and t.queued_tokens + tokens > lim.max_queued_tokens))

    def hold(self, w: Work) -> None:
        self._held.setdefault(w.tenant, deque()).append(w)
        self.paused.add(w.id)

    def holds_any(self) -> bool:
        return any(self._held.values())

    def held_count(self, tenant: str) -> int:
        return len(self._held.get(tenant, ()))

    def release(self, fills_gap: Callable[[Work], bool],
                enqueue: Callable[[Work], None]) -> None:
        """Queue (through `enqueue`, which counts it against the quota) the held work that
        fits its tenant's quota now, in arrival order, and any held op a model waits on."""
        for tenant, held in self._held.items():
            while held and (not self.over_quota(tenant, held[0].tokens) or fills_gap(held[0])):
                self._let_go(held, held[0], enqueue)
            for w in [w for w in held if fills_gap(w)]:  # it jumps the line
                self._let_go(held, w, enqueue)

    def _let_go(self, held: deque[Work], w: Work, enqueue: Callable[[Work], None]) -> None:
        held.remove(w)
        self.paused.discard(w.id)
        enqueue(w)

    def withdraw_sample(self, work_id: str, tenant: str) -> bool:
        """Drop a held sample (its client went away); False if none of that id is held."""
        held = self._held.get(tenant, ())
        for w in held:
            if w.id == work_id and w.kind == SAMPLE:
                held.remove(w)
                self.paused.discard(work_id)
                return True
        return False
