"""How the daemon's lanes are made (the service's first part, built once at its start):
one lane per executor, each with its planner, its adapter room and its engine core, all
sharing one fair-share ledger; and, when hosts may join, the lanes they bring. What a lane
does is lanes.py's; how an executor is made, make_executor.py's."""

from __future__ import annotations

from typing import Any

from scheduler import Ledger, Planner
from twinkled.core.adapter_room import adapter_room, host_room
from twinkled.core.exclusive import Exclusive
from twinkled.core.executor import Executor
from twinkled.core.futures import Futures
from twinkled.core.lanes import Lane, Lanes, make_lane
from twinkled.core.make_executor import zmq_executor
from twinkled.core.metrics import Metrics
from twinkled.core.remote_lanes import RemoteLanes, no_workers
from twinkled.protocol.config import Config
from twinkled.workers.hosts import host_registry


def make_lanes(config: Config, store: Any, futures: Futures, metrics: Metrics,
               executor: Executor | list[Executor] | None = None,
               adapter_budget: int | None = None, full_run_room: int | None = None) -> Lanes:
    """The service's lanes; the arguments are the Service's (service.py)."""
    hosts = host_registry(config) if executor is None else None  # (if hosts may join)
    if executor is None:  # (one lane: hosts without lanes bring ranks to its group)
        executor = [zmq_executor(config, devices, hosts if config.lanes == 1 else None,
                                 adapter_budget)
                    for devices in config.lane_devices()] or [no_workers(config)]
    executors = executor if isinstance(executor, list) else [executor]
    ledger = Ledger()  # tenants' fair-share clocks, one for all lanes (fairness.py)

    def lane(i: int, ex: Executor, on: str = "") -> Lane:
        return make_lane(i, Planner(config.token_budget, config.sample_budget,
                                    config.target_step_s, preempt_s=config.preempt_s,
                                    ledger=ledger),
                         ex, store, adapter_room(config, adapter_budget), futures,
                         metrics, config.gather_ms / 1000,
                         config.sample_slice_ms / 1000, host_room(config),
                         config.resident_cap, on, config.sample_long_slice_ms / 1000)
    lanes = Lanes([lane(i, ex) for i, ex in enumerate(executors)], store,
                  Exclusive(config.full_run_only_lane, full_run_room), config.long_row_tokens)
    if hosts is not None:  # and the lanes other hosts bring (remote_lanes.py)
        lanes.hosts = RemoteLanes.of_config(config, hosts, lanes, store, lane, adapter_budget)
    return lanes
