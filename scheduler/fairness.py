"""Tenants share the GPU by time: weighted fair queueing on virtual time.

Each tenant has a virtual time that advances by seconds / weight when it is served (its
share of a step's predicted time, from the cost model: what its rows add to the step, plus
its part of the step's fixed cost); the tenant with the smallest virtual time goes next.
Sharing by time rather than tokens matters when rows differ: a long row costs more per
token (attention), many short rows cost more per token (per-row work). A tenant that was idle re-enters at the
current virtual clock, so it cannot bank credit while away, and it wins ties against the
tenants already busy, so it is served in the next step.

With several lanes (independent worker groups, one planner each) the virtual times are one
`Ledger` for all of them: a tenant served on one lane is that much further along on every
lane, so a tenant with runs on two lanes gets its share once, not once per lane.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Limits:
    """Per-tenant quotas; None means unlimited."""

    max_queued_requests: int | None = None
    max_queued_tokens: int | None = None
    max_adapters: int | None = None
    max_rank: int | None = None
    # Checkpoints + user_metadata bytes; the store enforces it (not the scheduler).
    max_storage_bytes: int | None = None
    # Full-parameter runs (a lane each); the service enforces it (not the scheduler).
    max_full_runs: int | None = None


class Ledger:
    """Tenants' virtual times and the virtual clock, shared by the planners of every lane."""

    def __init__(self) -> None:
        self.vtimes: dict[str, float] = {}
        self.clock = 0.0  # virtual time of the most recent pick, on any lane


@dataclass
class Tenant:
    name: str
    weight: float = 1.0
    limits: Limits = field(default_factory=Limits)
    served_tokens: int = 0
    served_s: float = 0.0  # predicted seconds of training steps charged to it
    # The part of served_s from steps that left some tenant's work waiting: only there do
    # weights divide the time (when every tenant's work fits, each gets all it asks).
    contended_s: float = 0.0
    queued_requests: int = 0
    queued_tokens: int = 0
    rr: int = 0  # round-robin pointer over the tenant's models
    owed: float = 0.0  # seconds charged while idle, paid as it rejoins (`Fairness.activate`)
    ledger: Ledger = field(default_factory=Ledger, repr=False)  # where its vtime is kept

    @property
    def vtime(self) -> float:
        """Seconds served / weight, on every lane."""
        return self.ledger.vtimes.get(self.name, 0.0)

    @vtime.setter
    def vtime(self, value: float) -> None:
        self.ledger.vtimes[self.name] = value

    def charge(self, seconds: float, tokens: int = 0) -> None:
        self.vtime += seconds / self.weight
        self.served_s += seconds
        self.served_tokens += tokens


class Fairness:
    def __init__(self, ledger: Ledger | None = None) -> None:
        """`ledger`: the virtual times of every lane's planner (None: this one's own)."""
        self.tenants: dict[str, Tenant] = {}
        self.ledger = ledger or Ledger()

    @property
    def clock(self) -> float:
        return self.ledger.clock

    @clock.setter
    def clock(self, value: float) -> None:
        self.ledger.clock = value

    def tenant(self, name: str) -> Tenant:
        t = self.tenants.get(name)
        if t is None:
            t = self.tenants[name] = Tenant(name, ledger=self.ledger)
        return t

    def activate(self, t: Tenant) -> None:
        """Called when an idle tenant gets work: it joins at the current virtual clock,
        plus what it owes (`charge_aside`)."""
        t.vtime = max(t.vtime, self.clock)
        if t.owed:
            t.charge(t.owed)
            t.owed = 0.0

    def charge_aside(self, t: Tenant, seconds: float) -> None:
        """Work done for `t` outside a step (its adapter brought into the GPU bank). An idle
        tenant rejoins at the current clock, which would swallow a charge made now: it
        owes it instead, and pays as it rejoins (its request comes right behind the move)."""
        if t.queued_requests:
            t.charge(seconds)
        else:
            t.owed += seconds

    def pick(self, candidates: list[Tenant]) -> Tenant:
        # Ties go to the tenant served least: a newcomer beats the flooder it ties with.
        t = min(candidates, key=lambda c: (c.vtime, c.served_s, c.name))
        self.clock = max(self.clock, t.vtime)
        return t
