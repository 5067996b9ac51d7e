"""Tenants' weights and quotas, as the planner enforces them."""

from __future__ import annotations

import time
from typing import Any

from scheduler import Limits, Planner
from twinkled.protocol.config import Config
from twinkled.protocol.errors import UserError


class Tenants:
    def __init__(self, config: Config, store: Any, planners: list[Planner]):
        """`planners`: one per lane; each enforces a tenant's weight and queue quotas on
        its own lane, and the adapter quota counts the tenant's models on all of them."""
        self._config, self._store, self._planners = config, store, planners

    def refresh(self) -> None:
        """Weights and quotas: the store's (`twinkled ctl tenants set`) over the config's."""
        cfg = self._config
        for row in self._store.tenants.list():
            base = dict(cfg.tenants.get(row["name"], {}))
            weight = row["weight"] if row["weight"] != 1.0 else base.pop("weight", 1.0)
            base.pop("weight", None)
            limits = {k: row.get(k) or base.get(k) or getattr(cfg, f"tenant_{k}")
                      for k in self._store.tenants.LIMITS}
            for planner in self._planners:
                planner.set_tenant(row["name"], float(weight), Limits(**limits))

    def check_full_run(self, tenant: str, held: int) -> None:
        """Who may start a full-parameter run (the config's `full_runs`), and how many at
        once (`max_full_runs`; `held`: the tenant's now): a clear refusal, not a wait."""
        mode = self._config.full_runs
        if mode == "none":
            raise UserError("full-parameter runs (rank 0) are off on this daemon (full_runs = "
                            "\"none\"); use a LoRA rank of 1 or more")
        if mode == "marked" and not self._marked(tenant):
            raise UserError(f"tenant {tenant!r} may not start full-parameter runs (rank 0): "
                            "this daemon allows them only for tenants an admin marks "
                            f"(twinkled ctl tenants set {tenant} --max-full-runs N)")
        cap = self._planners[0].tenant(tenant).limits.max_full_runs
        if cap is not None and held >= cap:
            raise UserError(f"tenant {tenant!r} already has {held} full-parameter runs, its "
                            "quota")

    def _marked(self, tenant: str) -> bool:
        row = self._store.tenants.get(tenant) or {}
        return bool(row.get("max_full_runs")
                    or (self._config.tenants.get(tenant) or {}).get("max_full_runs"))

    def check_new_adapter(self, tenant: str, rank: int) -> None:
        """Quotas on adapters and rank: a clear refusal, not a wait."""
        lim = self._planners[0].tenant(tenant).limits
        if lim.max_rank is not None and rank > lim.max_rank:
            raise UserError(f"rank {rank} is over tenant {tenant!r}'s cap of {lim.max_rank}")
        if lim.max_adapters is not None:
            # Its runs in the GPU banks, and those parked for room (host memory or disk):
            # parking is the daemon's doing and must not free a place under the cap.
            mine = sum(planner.queues.count(tenant) for planner in self._planners)
            idle_s = self._config.idle_unload_s or float("inf")
            mine += self._store.runs.parked(tenant, time.time() - idle_s)
            if mine >= lim.max_adapters:
                raise UserError(f"tenant {tenant!r} already has {mine} runs loaded (in the GPU "
                                "bank or parked), its quota (max_adapters / "
                                "tenant_max_adapters); finish a session to free one")
