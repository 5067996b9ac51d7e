"""Lanes on other hosts: what a host brings with `twinkled worker --join --lanes N`, and
what losing it costs.

A host that joins with lanes (workers/host.py) gets one lane per slice of its devices, made
like the head's own (planner on the daemon's one fair-share Ledger, executor, residency,
core) around a `RemoteLaneGroup` (workers/remote_lane.py) and added to `Lanes`: runs are
placed there, balanced and moved like anywhere else, and `ctl status` says which host
each lane is on. Lanes are known by host name: a host that joins again gets its lanes
back (their groups restart on it, and balance and placement give them work), more if it
brings more.

A host that is lost (silent for `join_heartbeat_s`, or gone with a goodbye) costs only the
steps its lanes were running: those fail with the "restarted, submit it again" answer a
lost local lane gives, and what was queued behind them fails the same way as the lane
drains. Its runs leave at once, before those answers go out, so their next requests go
elsewhere: each becomes a run parked on disk (persisted state plus the journal after it,
which the head keeps), placed on another lane, and is brought in there by its next request
at its acknowledged step, its seq_ids going on after what it had sent. Checkpoint and live
state files are read from the same path on every host (a shared directory, for now).

Torch-free; runs on the daemon's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from twinkled.core.executor import Executor
from twinkled.core.lanes import Lane, Lanes
from twinkled.core.make_executor import worker_options
from twinkled.core.residency import stored_config
from twinkled.protocol.config import Config
from twinkled.workers.hosts import HostRegistry, RemoteHost, join_settings
from twinkled.workers.remote_lane import NoWorkers, RemoteLaneGroup

log = logging.getLogger("twinkled")
DRAIN_POLL_S = 0.05  # how often a lost lane looks whether its runs' last steps are answered


def no_workers(config: Config) -> Executor:
    """Lane 0's executor on a head with no workers of its own (`lanes = 0`): always down."""
    return Executor(NoWorkers(), Path(config.data_dir) / "live", config.persist_every,
                    config.journal_fsync)


class RemoteLanes:
    def __init__(self, registry: HostRegistry, lanes: Lanes, store: Any,
                 make: Callable[[str, int, list[str]], Lane], tp: int = 1):
        """`make(host, index, devices)`: lane `index` of `host`, on those devices, not
        started (numbered after the lanes there are); `tp`: the model's tensor-parallel
        size, which every lane's devices must make whole groups of."""
        self._registry, self._lanes, self._store, self._make = registry, lanes, store, make
        self._tp = tp
        self._known: dict[str, list[Lane]] = {}  # host name -> its lanes, in its order
        self._draining: set[asyncio.Task] = set()
        registry.on_join.append(self._joined)
        registry.on_drop.append(self._dropped)

    @classmethod
    def of_config(cls, config: Config, registry: HostRegistry, lanes: Lanes, store: Any,
                  lane: Callable[[int, Executor, str], Lane],
                  adapter_budget: int | None = None) -> RemoteLanes:
        """The daemon's: `lane(index, executor, host)` makes a lane as the head's are
        (`adapter_budget`: the head's, `worker_options`)."""
        def make(host: str, index: int, devices: list[str]) -> Lane:
            group = RemoteLaneGroup(registry, join_settings(config), host, index,
                                    worker_options(config, devices, adapter_budget),
                                    config.step_timeout_s)
            executor = Executor(group, Path(config.data_dir) / "live", config.persist_every,
                                config.journal_fsync)
            return lane(len(lanes.all), executor, host)
        return cls(registry, lanes, store, make, config.tp)

    async def open(self) -> None:
        await self._registry.open()

    async def close(self) -> None:
        for task in self._draining:
            task.cancel()
        await self._registry.close()

    def _joined(self, host: RemoteHost) -> None:
        """New lanes for what the host brings beyond the lanes it had (those restart on it
        by themselves: RemoteLaneGroup)."""
        if not host.lanes:
            return
        known = self._known.setdefault(host.name, [])
        for index in range(len(known), len(host.lanes)):
            if len(host.lanes[index]) % self._tp:
                log.error("host %s: lane %d's %d device(s) make no whole tensor-parallel "
                          "groups of %d: it and the lanes after it are left out", host.name,
                          index, len(host.lanes[index]), self._tp)
                return
            lane = self._make(host.name, index, host.lanes[index])
            known.append(lane)
            self._lanes.add(lane)
            log.info("lane %d: lane %d of host %s (%s)", lane.index, index, host.name,
                     ",".join(host.lanes[index]))

    def _dropped(self, host: RemoteHost, why: str) -> None:
        lost = self._known.get(host.name, [])
        for lane in lost:  # first, so that none of them is chosen for the others' runs
            lane.executor.group.lose(why)
        for lane in lost:
            moved = self.evacuate(lane, why)
            if moved:
                log.warning("lane %d lost with host %s: its %d run(s) go to other lanes at "
                            "their acknowledged steps", lane.index, host.name, len(moved))

    def evacuate(self, dead: Lane, why: str) -> list[str]:
        """Every run placed on `dead` (whose host is gone) is parked on disk and placed on
        another lane, at once; its next request brings it in there (Lanes.ensure_loaded).
        What of them is still queued or running on `dead` fails there as it drains."""
        live = dead.residency.live_configs()
        dead.residency.tiers.host_lost()  # (a ParkF wrote what went to host memory)
        moved = []
        for model in self._lanes.homed_on(dead):
            run = self._store.runs.get(model)
            if model in live:
                # its seq_ids go on after what its client sent (what is queued fails here)
                resume = dead.planner.queues.seq_after_queued(model) \
                    if model in dead.planner.queues else None
                dead.residency.lost(model, why)
                dead.residency.tiers.forget(model)
                self._store.runs.set_live(model, False, next_seq=resume, idle_unloaded=True)
            dead.executor.journal.release(model)  # the next lane's journal goes on with it
            self._lanes.exclusive.release(model)  # (a full run reserves a lane anew)
            if run is not None and run["lora_rank"] and self._lanes.up():
                self._lanes.place(model, self._lanes.choose(stored_config(run), model))
            moved.append(model)
        task = asyncio.get_running_loop().create_task(self._drain(dead))
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)
        return moved

    async def _drain(self, dead: Lane) -> None:
        """Close the lost lane's queues once their last ops are answered (they fail)."""
        while True:
            for model in list(dead.planner.queues.seqs()):
                dead.planner.forget_model(model)  # (not while it has ops queued or running)
            if not dead.planner.queues.count():
                return
            await asyncio.sleep(DRAIN_POLL_S)
