"""Lanes: the daemon's devices split into independent worker groups, each with its own loop.

A lane is one worker group (its devices: one GPU, or several for data or tensor
parallelism inside it) and what feeds it: its planner, executor, residency and engine core.
A model (a training adapter) lives on one lane, placed when it is created or loaded; all
its ops go there. Lanes do not wait for each other: each gathers, plans and steps on its
own tenants, and a worker that dies restarts its lane only. For many small tenants that is
what scales over GPUs: a data-parallel group holds every adapter on every GPU and steps in
lock step (docs/internals.md, "Scaling over GPUs").

Futures, the store and the metrics are the daemon's, one for all lanes. With one lane (the
default) this is the single worker group the daemon always had. Hosts that join bring
lanes too (remote_lanes.py), down (taking no work) while their host is gone.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from scheduler import Planner
from twinkled.core.adapter_room import AdapterRoom
from twinkled.core.engine_core import EngineCore
from twinkled.core.exclusive import Exclusive
from twinkled.core.executor import Executor
from twinkled.core.futures import Future, Futures
from twinkled.core.long_rows import LongRuns
from twinkled.core.metrics import Metrics
from twinkled.core.residency import Residency, stored_config
from twinkled.protocol import trace
from twinkled.protocol.errors import UserError
from twinkled.protocol.types import LoraConfig
from twinkled.workers.gaps import GapWindow


class HostLanes(Protocol):
    """The lanes other hosts bring (remote_lanes.RemoteLanes, which imports this module):
    opened and closed with the local ones."""

    async def open(self) -> None: ...
    async def close(self) -> None: ...


log = logging.getLogger("twinkled")

# Sampler adapters whose lane is remembered (those of runs not placed here: a restarted
# daemon's, say); past this the oldest are forgotten (they load again where they next go).
SAMPLERS_KEPT = 4096


@dataclass
class Lane:
    index: int
    planner: Planner
    executor: Executor
    residency: Residency
    core: EngineCore
    host: str = ""  # the joined host it runs on ("" : this one)

    @property
    def down(self) -> str:
        """Why no work goes to this lane now ("" when it may): only a lane on another host
        is ever down, while its host is gone (workers/remote_lane.py)."""
        return getattr(self.executor.group, "down", "")

    @property
    def devices(self) -> list[str]:
        return getattr(self.executor.group, "lane_devices", None) or self.executor.group.devices


def make_lane(index: int, planner: Planner, executor: Executor, store: Any,
              room: AdapterRoom, futures: Futures, metrics: Metrics, gather_s: float,
              slice_s: float, host: AdapterRoom | None = None,
              cap: Callable[[str], int | None] = lambda _: None, on: str = "",
              long_slice_s: float = 2.0) -> Lane:
    """`room`: the GPU bank's budget; `host`: the host tier's (core/tiers.py); `cap`: a
    tenant's resident bytes cap (Residency); `on`: the joined host it runs on; `slice_s`,
    `long_slice_s`: sampling's slices (PendingSamples)."""
    residency = Residency(store, planner, executor, room, host, cap)
    executor.serve(residency, on_restart=metrics.worker_restarts.inc)
    core = EngineCore(planner, executor, futures, residency, metrics, gather_s, slice_s,
                      long_slice_s)
    return Lane(index, planner, executor, residency, core, on)


class Lanes:
    def __init__(self, lanes: list[Lane], store: Any, exclusive: Exclusive | None = None,
                 long_row_tokens: int = 0):
        self.all = lanes
        self._own = list(lanes)  # this host's (`add`ed lanes run their loops themselves)
        self.planners = [lane.planner for lane in lanes]  # (Tenants sets quotas on each)
        self.hosts: HostLanes | None = None  # the lanes other hosts bring, if they may
        self._added: list[asyncio.Task] = []  # their loops
        self._store = store
        self._home: dict[str, Lane] = {}  # model -> the lane it was placed on
        self._samplers: dict[str, Lane] = {}  # sampler adapter -> the lane that holds it
        self._turn = 0  # round robin for base-model samples
        self._reloading: dict[str, asyncio.Lock] = {}  # model -> one reload at a time
        # lanes held by full-parameter runs (exclusive.py)
        self.exclusive = exclusive or Exclusive()
        self.moved_runs = 0  # runs moved between lanes to balance them (balance.py)
        self.long = LongRuns(long_row_tokens)  # long-context runs, kept apart (long_rows.py)

    # -- where things go ----------------------------------------------------------------

    def of(self, model: str | None) -> Lane:
        """The lane `model` was placed on. A model never placed is loaded nowhere: lane 0,
        whose core says so to its requests."""
        return self._home.get(model, self.all[0]) if model is not None else self.all[0]

    def up(self) -> list[Lane]:
        """The lanes work may go to now (not those of a host that is gone)."""
        return [lane for lane in self.all if not lane.down]

    def is_open(self, model: str) -> bool:
        """Whether `model` takes operations on its lane now (created, restored, reloaded)."""
        return self.of(model).residency.is_open(model)

    def choose(self, config: LoraConfig, model: str | None = None) -> Lane:
        """A lane for a new adapter of `config` (or run `model`'s, brought back): the one
        with the fewest models among those with room for it (lowest index first), of
        those its kind goes to (a long run's lanes or the others: long_rows.py). No room
        anywhere: the refusal of the lane with the most room left, which says why."""
        up = self.up() or self.all
        shared = self.exclusive.shared(up)
        if not shared:  # (one lane, held: full_run_only_lane)
            raise self.exclusive.none_shared(up, "LoRA runs (new or loaded)")
        if len(shared) == 1:
            return shared[0]
        fits = [lane for lane in shared if lane.residency.room.fits(config)]
        if fits:
            return min(self.long.prefer(fits, model),
                       key=lambda lane: (lane.planner.queues.count(), lane.index))
        return min(shared, key=lambda lane: (lane.residency.room.used(), lane.index))

    def place(self, model: str, lane: Lane) -> None:
        self._home[model] = lane

    def for_sample(self, adapter: str | None) -> Lane:
        """Where a sample runs: with a sampler checkpoint's adapter, on the lane of the run
        that saved it (its workers keep a device copy of sampler weights), else on one
        lane kept for that adapter (its workers load it once); the base model's samples
        take turns."""
        up = self.up() or self.all
        run = _run_of(adapter) if adapter is not None else None
        home = self._home.get(run) if run is not None else None
        if home is not None and not home.down and self.exclusive.open_to(home, run):
            return home  # (a full run's samplers: its own lane)
        # Never a lane whose base model a full run is training (no lane: a clear 400).
        shared = self.exclusive.shared(up)
        if not shared:
            raise self.exclusive.none_shared(
                up, "base-model samples" if adapter is None else "samples of saved weights")
        if adapter is None:
            self._turn = (self._turn + 1) % len(shared)
            return shared[self._turn]
        known = self._samplers.get(adapter)
        if known is None or known.down or known.index not in {s.index for s in shared}:
            if len(self._samplers) >= SAMPLERS_KEPT:  # forget the oldest half
                for key in list(self._samplers)[:SAMPLERS_KEPT // 2]:
                    del self._samplers[key]
            self._turn = (self._turn + 1) % len(shared)
            self._samplers[adapter] = shared[self._turn]
        return self._samplers[adapter]

    def model_info(self) -> dict:
        """What the workers say of the model (of the first lane up that has said it)."""
        return next((lane.executor.model_info for lane in self.all
                     if lane.executor.model_info), {})

    def homed_on(self, lane: Lane) -> list[str]:
        """The models placed on `lane`."""
        return [model for model, home in self._home.items() if home is lane]

    def find(self, test: Callable[[Lane], bool]) -> bool:
        """Whether `test` holds on some lane (tried in order, stopping at the first)."""
        return any(test(lane) for lane in self.all)

    # -- life cycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Start every lane's worker group (each loads the model), then bring back the
        adapters live at the last stop, spread over the lanes."""
        runs = self._store.runs.live()  # live at the last stop (read before anything reloads)
        mine = self.up()  # (hosts that join meanwhile bring lanes of their own)
        if self.hosts is not None:
            await self.hosts.open()
        if not mine:  # no workers here: they come back on hosts' lanes, on their next request
            for run in runs:
                self._store.runs.set_live(run["id"], False, next_seq=run["next_seq"],
                                          idle_unloaded=True)
            return
        await asyncio.gather(*(lane.executor.start() for lane in mine))
        shares: dict[int, list[dict]] = {lane.index: [] for lane in mine}
        for run in sorted(runs, key=lambda r: r["lora_rank"] != 0):  # full runs first
            if run["lora_rank"] == 0:  # a lane of its own (exclusive.py)
                try:
                    lane = self.exclusive.reserve(mine, run["id"], run["tenant"])
                except UserError as e:  # (fewer lanes than at the last stop)
                    log.error("full-parameter run %s not restored: %s", run["id"], e)
                    continue
                self.place(run["id"], lane)
                shares[lane.index].append(run)
                continue
            # what was live comes back, room or not: spread evenly
            shared = self.exclusive.shared(mine)
            if not shared:  # one lane, a full run's (full_run_only_lane): on its next request
                self._store.runs.set_live(run["id"], False, next_seq=run["next_seq"],
                                          idle_unloaded=True)
                continue
            lane = min(shared, key=lambda lane: (len(shares[lane.index]), lane.index))
            self.place(run["id"], lane)
            shares[lane.index].append(run)
        for lane in mine:
            await lane.residency.restore_at_start(shares[lane.index])

    def add(self, lane: Lane) -> None:
        """A lane another host brought (remote_lanes.py): down until it has loaded the
        model; it runs its own loop."""
        self.all.append(lane)
        self.planners.append(lane.planner)

        async def run() -> None:
            try:
                await lane.executor.start()  # (down, not raised, if its ranks fail)
            except Exception:  # it stays down; its host joining again restarts it
                log.exception("lane %d of host %s did not start", lane.index, lane.host)
            trace.in_lane(lane.index)
            await asyncio.gather(lane.executor.watch(), lane.core.run())

        self._added.append(asyncio.get_running_loop().create_task(run()))

    def watchers(self) -> list:
        return [lane.executor.watch() for lane in self._own]

    async def run(self) -> None:
        """Every lane's loop, side by side (each in its own task)."""
        async def loop(lane: Lane) -> None:
            trace.in_lane(lane.index)
            await lane.core.run()

        await asyncio.gather(*(loop(lane) for lane in self._own))

    async def stop(self) -> None:
        for task in self._added:
            task.cancel()
        await asyncio.gather(*(lane.executor.stop() for lane in self.all))
        if self.hosts is not None:
            await self.hosts.close()

    def idle(self) -> bool:
        return all(lane.core.idle() for lane in self.all)

    @property
    def recovering(self) -> bool:
        return any(lane.executor.recovering for lane in self.all)

    # -- what spans the lanes -----------------------------------------------------------

    def settle_last_stop(self) -> None:
        """Work the last stop cut short, before anything runs: its futures fail with a
        clear error when polled (their clients submit them again, so their journaled ops
        are never replayed too), an optim_step behind a cut forward_backward fails with
        it, and half-written checkpoints are marked and never served."""
        store = self._store
        cut = store.futures.pending_ids()
        for lane in self.all:
            lane.executor.journal.void(cut)
        failed = store.futures.fail_pending(
            "the daemon restarted before this request finished; submit it again")
        for model, seq, why, category in store.futures.failed_training():
            for lane in self.all:
                lane.core.lost_before_restart(model, seq, why, category)
        for c in store.checkpoints.abandon_writing("the daemon stopped while writing it"):
            log.warning("checkpoint %s was cut short by a stop; marked corrupt", c["tinker_path"])
        if failed:
            log.warning("%d requests were cut short by the last stop", failed)

    async def ensure_loaded(self, run: dict) -> None:
        """Bring back an adapter unloaded while idle, on the lane with room for it. Two
        requests for it at once: the second finds it loaded (never a copy on two lanes)."""
        model = run["id"]
        async with self._reloading.setdefault(model, asyncio.Lock()):
            if self.of(model).residency.is_open(model):
                return
            # Parked in a lane's host memory: back on that lane; else where there is room.
            here = self.of(model)
            if run["lora_rank"] == 0:  # a full run: its lane (kept while idle unloaded)
                lane = self.exclusive.reserve(self.up(), model, run["tenant"])
            else:
                lane = here if here.residency.keeps(model) else self.choose(stored_config(run), model)
            if lane is not here:  # its journal goes on in the other lane's executor
                here.executor.journal.release(model)
                here.residency.tiers.hand_over(model, lane.residency.tiers)
            self.place(model, lane)
            await lane.residency.ensure_loaded(run)

    async def move(self, model: str, to: Lane) -> bool:
        """Move an idle run to lane `to` (core/balance.py): its state through the disk, its
        next requests there; False if it cannot go now (work came in meanwhile)."""
        async with self._reloading.setdefault(model, asyncio.Lock()):
            here = self.of(model)
            if here is to or not await here.residency.send_away(model):
                return False
            here.executor.journal.release(model)
            self.place(model, to)
            self.moved_runs += 1
            try:
                await to.residency.ensure_loaded(self._store.runs.get(model))
            except Exception as e:  # it stays on disk: its next request tries again
                log.warning("run %s moved to lane %d but could not be brought in: %s",
                            model, to.index, e)
            log.info("run %s moved from lane %d to lane %d", model, here.index, to.index)
            return True

    async def unload_idle(self, idle_s: float) -> None:
        for lane in self.all:
            await lane.residency.unload_idle(idle_s)

    async def persist_all(self) -> int:
        return sum([await lane.residency.persist_all() for lane in self.all])

    def withdraw(self, f: Future, why: str) -> bool:
        return self.find(lambda lane: lane.core.withdraw(f, why))

    def tenant_status(self) -> dict[str, dict]:
        """Each tenant's queue and service, summed over the lanes; its share of all
        lanes' training time."""
        merged: dict[str, dict] = {}
        for lane in self.all:
            for name, t in lane.planner.status().items():
                m = merged.setdefault(name, {**t, "queued_requests": 0, "queued_tokens": 0,
                                             "paused": 0, "served_tokens": 0, "served_s": 0.0,
                                             "contended_s": 0.0})
                for key in ("queued_requests", "queued_tokens", "paused", "served_tokens",
                            "served_s", "contended_s"):
                    m[key] += t[key]
        total = sum(t["served_s"] for t in merged.values()) or 1.0
        contended = sum(t["contended_s"] for t in merged.values())
        for t in merged.values():
            t["share"] = t["served_s"] / total
            t["contended_share"] = t["contended_s"] / contended if contended else None
        return merged

    def status(self) -> dict:
        """The workers' side of the daemon's status, summed over the lanes (the step target
        and cost are lane 0's); with several lanes, each lane's own under "lanes"."""
        first = self.all[0]
        restarts = [lane.executor.status()["restarts"] for lane in self.all]
        status = {"devices": [d for lane in self.all for d in lane.devices],
                  "steps": sum(lane.planner.steps for lane in self.all),
                  "adapters": self.model_count(), "tenants": self.tenant_status(),
                  "step_target_ms": _ms(first.planner.step_target()),  # None: no time bound
                  "step_cost": first.planner.cost.describe(), "workers": self.workers(),
                  "restarts": sum(restarts),
                  "live_adapters": sum(lane.residency.count() for lane in self.all),
                  "tiers": self.tiers(),
                  # decoding across steps
                  "samples_running": sum(len(lane.core.samples) for lane in self.all),
                  "logprob_gap": self.logprob_gap(),
                  "full_runs": self.exclusive.status()}  # the lanes they hold
        if len(self.all) > 1:
            here = socket.gethostname()
            status["lanes"] = [
                {"lane": lane.index, "devices": lane.devices, "host": lane.host or here,
                 "remote": bool(lane.host), "down": lane.down or None,
                 "steps": lane.planner.steps, "adapters": lane.planner.queues.count(),
                 "step_target_ms": _ms(lane.planner.step_target()),
                 "restarts": restarts[lane.index], **lane_load(lane),
                 "long": bool(self.long.on(lane)),  # a lane of long-context runs
                 "tiers": lane.residency.tiers.status()} for lane in self.all]
            status["lane_moves"] = self.moved_runs
            status["long_runs"] = self.long.status(self.all)  # (admin only: names runs)
        return status

    def tiers(self) -> dict:
        """Adapters per residency tier over every lane, and the moves so far (tiers.py)."""
        moves: Counter[str] = Counter()
        prefetch: Counter[str] = Counter()
        for lane in self.all:
            moves.update(lane.residency.tiers.moves)
            prefetch.update(lane.residency.tiers.prefetch)
        return {"gpu": sum(lane.residency.count() for lane in self.all),
                "host": sum(lane.residency.tiers.status()["host"] for lane in self.all),
                "moves": dict(moves),
                "moved_bytes": sum(lane.residency.tiers.moved_bytes for lane in self.all),
                "prefetch": {"hits": prefetch["hits"], "misses": prefetch["misses"]},
                "churn": sum(lane.residency.tiers.churn for lane in self.all),
                "started_parked": sum(lane.residency.tiers.started_parked for lane in self.all)}

    def logprob_gap(self) -> dict:
        """Sampler vs trainer logprobs of recently checked samples, over every lane
        (workers/gaps.py: GapWindow.summary)."""
        return GapWindow.summary(lane.executor.gaps for lane in self.all)

    def model_count(self) -> int:
        return sum(lane.planner.queues.count() for lane in self.all)

    def workers(self) -> list[dict]:
        """Every lane's worker ranks, each with its lane."""
        return [{**w, "lane": lane.index} for lane in self.all
                for w in lane.executor.status()["workers"]]


def lane_load(lane: Lane) -> dict:
    """What a lane carries now (`ctl status`): adapters in its GPU bank (the load the
    lanes are balanced by), and its queued work."""
    queued = lane.planner.status().values()
    return {"load": lane.residency.count(), "queued_requests": sum(t["queued_requests"] for t in queued),
            "queued_tokens": sum(t["queued_tokens"] for t in queued)}


def _ms(seconds: float) -> float | None:
    return round(seconds * 1e3, 1) if seconds < float("inf") else None


def _run_of(adapter: str) -> str | None:
    """The run a sampler adapter's checkpoint belongs to ("sampler:tinker://RUN/...")."""
    path = adapter.removeprefix("sampler:")
    if not path.startswith("tinker://"):
        return None
    return path.removeprefix("tinker://").split("/", 1)[0]
