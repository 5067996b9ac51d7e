"""Residency: the one owner of adapter liveness.

Which training adapters the workers hold (with the config a restore re-creates them from),
which models accept operations (their queue in the planner), and the store's `live` flag
that brings them back after a restart: all three change here and only here. Adapters are
restored at start-up, parked out of the GPU bank when it is full (the least recently used
idle ones, to host memory then disk: tiers.py) or when idle (persisted first), and brought
back on their next request. The executor asks `live_configs` when a restarted worker group
must get them back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scheduler import Planner
from twinkled.core.adapter_room import AdapterRoom, check_cap, check_disk
from twinkled.core.executor import Executor
from twinkled.core.ops import Outcome
from twinkled.core.tier_moves import Needer, TierMoves
from twinkled.core.tiers import Tiers
from twinkled.protocol.errors import HOST_ROOM, Draining, UserError
from twinkled.protocol.frames import CreateF, IdleUnloadF, LoadF, OpF, ParkF, UnloadF
from twinkled.protocol.types import (
    ATTN_MODULES,
    MLP_MODULES,
    UNEMBED_MODULES,
    AdapterInfo,
    LoraConfig,
)

log = logging.getLogger("twinkled")
# How often a request whose adapter waits for room looks again, while every resident adapter
# has work queued (each op that completes may free one).
ROOM_POLL_S = 0.02


def stored_config(run: dict) -> LoraConfig:
    """The config a run was created with, as its store row keeps it."""
    return LoraConfig(**{k: v for k, v in (run["lora_config"] or {}).items()
                         if k in LoraConfig.__dataclass_fields__})


def loaded_config(info: AdapterInfo) -> LoraConfig:
    """The config of an adapter loaded from a checkpoint, as the engine reports it."""
    t = set(info.target_modules)
    return LoraConfig(rank=info.rank, alpha=info.alpha, train_attn=ATTN_MODULES[0] in t,
                      train_mlp=MLP_MODULES[0] in t, train_unembed=UNEMBED_MODULES[0] in t,
                      optimizer=info.optimizer)


class Residency:
    def __init__(self, store: Any, planner: Planner, executor: Executor,
                 room: AdapterRoom | None = None, host: AdapterRoom | None = None,
                 cap: Callable[[str], int | None] = lambda _: None):
        """`cap(tenant)`: the bytes of its adapters the GPU bank holds at once (None: no
        cap; beyond it its own least recently used idle ones are parked)."""
        self._store = store
        self._cap = cap
        self._planner = planner
        self._executor = executor
        self.room = room or AdapterRoom(None, lambda _: 0)  # GPU memory for adapters
        # where parked adapters are, and which to park next
        self.tiers = Tiers(self.room, host or AdapterRoom(0, lambda _: 1))
        self._live: dict[str, LoraConfig] = {}  # training adapters in the GPU bank
        self._locks: dict[str, asyncio.Lock] = {}  # moves of one model, one at a time
        self._admitting = asyncio.Lock()  # one maker of room at a time
        self._rebalancing: asyncio.Task | None = None
        self._waiting: set[asyncio.Task] = set()  # new models' waits for room (`when_room`)
        self._parking: set[asyncio.Task] = set()  # parks under way (`_park_locked`)
        # models in `make_room`: their configs and tenants (one park makes room for all)
        self._wanting: dict[str, tuple[LoraConfig, str | None]] = {}
        self._stopping = False  # the daemon is stopping: no wait for room goes on
        # the workers' moves between the tiers, each charged to the tenant that needs it
        self.moves = TierMoves(executor, planner, self.tiers, self._moving)
        executor.on_restart(lambda _why: self.tiers.host_lost())

    # -- what is live -------------------------------------------------------------------

    def is_open(self, model: str) -> bool:
        """The model takes operations (created, restored or reloaded; not yet closed)."""
        return model in self._planner.queues

    def live_configs(self) -> dict[str, LoraConfig]:
        return dict(self._live)

    def count(self) -> int:
        return len(self._live)

    def check(self, config: LoraConfig, tenant: str) -> None:
        """Refuse at the door, with the numbers, an adapter this lane could never hold: more
        than the whole GPU budget, than `tenant`'s resident cap, or than the free disk its
        state needs (the last tier). Anything else waits for room, never refused."""
        self.room.check(config)
        check_cap(config, self.room.size(config), tenant, self._cap(tenant))
        # its state on disk: fp32 weights and two moments, 12 of the bank's 20 bytes a
        # parameter (0 where the bank is unbounded: no model numbers to size it by)
        check_disk(Path(self._executor.live_dir), self.room.size(config) * 3 // 5)

    def _over_cap(self, tenant: str | None, config: LoraConfig | None = None) -> bool:
        """`tenant`'s adapters in the bank (and one of `config` coming in) are over its cap."""
        cap = None if tenant is None else self._cap(tenant)
        if cap is None:
            return False
        mine = sum(self.room.held(m) for m in self._planner.queues.models_of(tenant))
        return mine + (self.room.size(config) if config is not None else 0) > cap

    # -- what steps did -----------------------------------------------------------------

    def open(self, model: str, tenant: str, first_seq: int = 1, resync: bool = False) -> None:
        """A model starts taking operations, from `first_seq` (its create or load is op 0).
        A new one holds its room at once: if the bank is over its budget now, the least
        recently used idle adapters are parked right behind it."""
        self._planner.open_model(model, tenant, first_seq, resync=resync)
        self.tiers.touch(model)
        if ((self.room.over() or self._over_cap(tenant))
                and (self._rebalancing is None or self._rebalancing.done())):
            self._rebalancing = asyncio.get_running_loop().create_task(
                self._rebalance(tenant))

    def note(self, frame: OpF, outcome: Outcome) -> None:
        """What an op that ran changed: a created or loaded adapter is live (a restart
        brings it back); an unloaded one is not."""
        result, error, _ = outcome
        model = frame.adapter_id
        if model is not None:
            self.tiers.touch(model)
        if error is not None and isinstance(frame, CreateF | LoadF) and model not in self._live:
            self.room.release(model)  # it never came to be
        if error is None and isinstance(frame, CreateF):
            # The config it was made from, seed included: a restore before its first
            # persisted state re-creates the same initial weights, and the journal replays.
            self._live[model] = frame.config
            self._store.runs.set_live(model, True)
        elif error is None and isinstance(frame, LoadF):
            self._live[model] = loaded_config(result)
            self.room.hold(model, self._live[model])
            self._store.runs.set_live(model, True)
        elif isinstance(frame, UnloadF):
            self._live.pop(model, None)
            self.room.release(model)
            self.tiers.forget(model)
            self._store.runs.set_live(model, False)

    def close(self, model: str) -> None:
        """An unloaded model's queue goes (once its last op has completed)."""
        self._planner.forget_model(model)

    def lost(self, model: str, why: str) -> None:
        """The executor could not bring an adapter back after a worker fault: its requests
        now fail in the engine ("no adapter loaded") until its client loads a checkpoint."""
        self._live.pop(model, None)
        self.room.release(model)

    # -- start-up, idle unload, reload, shutdown -----------------------------------------

    async def restore_at_start(self, runs: list[dict] | None = None) -> None:
        """Adapters live at the last stop (or `runs` of them: this lane's share), from
        their persisted state. After a hot restart their seq_ids continue exactly; after a
        crash the first request resumes them."""
        runs = self._store.runs.live() if runs is None else runs
        runs = self._park_beyond_budget(runs)
        configs = {r["id"]: stored_config(r) for r in runs}
        failed = await self._executor.restore(configs)
        for r in runs:
            if r["id"] in failed:
                log.error("run %s could not be restored: %s", r["id"], failed[r["id"]])
                self._store.runs.set_live(r["id"], False)
                continue
            self._live[r["id"]] = configs[r["id"]]
            self.room.hold(r["id"], configs[r["id"]])
            self.open(r["id"], r["tenant"], r["next_seq"] or 1, resync=r["next_seq"] is None)
            self._store.runs.set_live(r["id"], True)  # forget next_seq: a crash resyncs
        if runs:
            log.info("restored %d adapter(s)", len(runs) - len(failed))

    def _park_beyond_budget(self, runs: list[dict]) -> list[dict]:
        """The runs to restore into the GPU bank at start-up: as many as its budget holds
        (in order); the others are parked on disk (their persisted state and journal bring
        them back on their next request, their seq_ids where they were)."""
        fit, used = [], self.room.used()
        for r in runs:
            size = self.room.size(stored_config(r))
            if self.room.budget is None or used + size <= self.room.budget or not fit:
                fit.append(r)
                used += size
            else:
                self._store.runs.set_live(r["id"], False, next_seq=r["next_seq"],
                                          idle_unloaded=True)
        if len(fit) < len(runs):
            log.info("%d adapter(s) beyond the GPU budget stay parked on disk",
                     len(runs) - len(fit))
        return fit

    async def unload_idle(self, idle_s: float) -> None:
        """Free the memory of adapters idle for `idle_s` (clients that went away without
        finishing their session): to disk, from the GPU bank or from host memory. They
        come back, at the same weights and seq_ids, on their next request (`ensure_loaded`)."""
        for run in self._store.runs.idle(time.time() - idle_s):
            model = run["id"]
            if run["lora_rank"] == 0:  # a full run holds its lane until its session ends
                continue
            async with self._locks.setdefault(model, asyncio.Lock()):
                if model in self._live and await self._park(model, to_host=False):
                    log.info("adapter %s unloaded after %.0f s idle", model, idle_s)
        async with self._admitting:
            for model in self.tiers.on_host_models():
                if (time.monotonic() - self.tiers.last_used(model) >= idle_s
                        and not self._moving(model)):
                    await self.moves.host_to_disk(model)

    async def ensure_loaded(self, run: dict) -> None:
        """Bring back a parked adapter (or one unloaded while idle) before a request for it
        is queued: room is made in the GPU bank first, waiting if need be (never refused)."""
        model = run["id"]
        if self.is_open(model):
            return
        async with self._locks.setdefault(model, asyncio.Lock()):
            fresh = self._store.runs.get(model)
            if self.is_open(model) or not (fresh and fresh["idle_unloaded"]):
                return  # loaded meanwhile, or never unloaded (submit says why not loaded)
            config = stored_config(fresh)
            self.tiers.touch(model)
            await self.make_room(model, config, fresh["tenant"])
            why = await self.moves.bring_in(model, config, fresh["tenant"])
            if why is not None:
                self.room.release(model)
                raise UserError(f"model {model} was parked and could not be brought back: "
                                f"{why}")
            self._live[model] = config
            self.open(model, fresh["tenant"], fresh["next_seq"] or 1,
                      resync=fresh["next_seq"] is None)
            self._store.runs.set_live(model, True)

    def keeps(self, model: str) -> bool:
        """The model must come back on this lane: parked in its workers' host memory, or
        a move of it under way."""
        lock = self._locks.get(model)
        return self.tiers.on_host(model) or (lock is not None and lock.locked())

    def movable(self) -> list[str]:
        """Resident adapters with nothing queued or in flight and no move under way, least
        recently used first: those that may go to another lane (core/balance.py)."""
        return [m for m in self.tiers.coldest(self._live) if not self._planner.queues.busy(m)
                and not self._moving(m)]

    def _moving(self, model: str) -> bool:
        """A move of `model` is under way (parked, brought in, sent away): its lock is held."""
        lock = self._locks.get(model)
        return lock is not None and lock.locked()

    async def send_away(self, model: str) -> bool:
        """Out of this lane for another (core/balance.py): persisted to disk and closed,
        as an idle unload; the other lane brings it in (`ensure_loaded`) from there. False
        if it cannot go now (work came in, or it is being moved)."""
        lock = self._locks.setdefault(model, asyncio.Lock())
        if lock.locked() or model not in self._live:
            return False
        async with lock:
            if not await self._park(model, to_host=False):
                return False
        self.tiers.forget(model)
        return True

    async def persist_all(self) -> int:
        """Every live adapter on disk, and where each model's seq_ids go on (a hot restart
        continues them exactly). Returns how many adapters were live."""
        # Waits for room end first (each holds `_admitting` while every resident adapter
        # has work queued, which at a stop may never run): their requests hear "again".
        self._stopping = True
        for task in self._waiting:
            task.cancel()
        async with self._admitting:
            for model in self.tiers.on_host_models():  # host memory does not outlive us
                await self.moves.host_to_disk(model)
        await self._executor.persist_all()
        for model in self._planner.queues.seqs():
            self._store.runs.set_live(model, True, next_seq=self._resumes_at(model))
        return len(self._live)

    # -- the tiers: making room, parking, bringing back ------------------------------------

    async def make_room(self, model: str, config: LoraConfig, needer: str | None = None
                        ) -> None:
        """Room in the GPU bank for `model`'s adapter, held for it: the least recently
        used idle adapters are parked until it fits, and while every resident one has work
        queued, this waits for one to finish (an op completes every step). The moves are
        charged to `needer`'s fair share (the tenant whose adapter needs the room); a park
        that makes room for several waiting runs, to their tenants in equal shares."""
        self.room.check(config)  # only what could never fit is refused
        self._wanting[model] = config, needer  # (counted by the parks of those ahead of it)
        try:
            await self._make_room(model, config, needer)
        finally:
            self._wanting.pop(model, None)

    async def _make_room(self, model: str, config: LoraConfig, needer: str | None) -> None:
        while True:  # over its tenant's cap: its own adapters make room first
            async with self._admitting:  # (waiting for them outside: others go on)
                if not self._over_cap(needer, config):
                    break
                parked = await self._park_coldest(incoming=model, needer=needer, only=needer)
            if not parked:
                await self._poll()
        async with self._admitting:
            while not self.room.fits(config):
                want, needers = self._wanted()
                if not await self._park_coldest(incoming=model, needer=needers, want=want):
                    await self._poll()
            self.room.hold(model, config)

    def _wanted(self) -> tuple[int, tuple[str, ...]]:
        """The bytes the bank must free so that every adapter waiting for room fits (one
        park for all of them: `_park_coldest`), and the tenants who share its cost."""
        waiting = [(c, t) for m, (c, t) in self._wanting.items() if not self.room.held(m)]
        need = sum(self.room.size(c) for c, _ in waiting)
        return (need + self.room.used() - (self.room.budget or 0),
                tuple(t for _, t in waiting if t is not None))

    async def _poll(self) -> None:
        """Between two tries to make room; a stop ends the wait (`persist_all`)."""
        if not self._stopping:
            await asyncio.sleep(ROOM_POLL_S)
        if self._stopping:
            raise Draining("the daemon is stopping (restarting) before this request's "
                           "adapter had room in the GPU bank; submit it again")

    def has_room(self, config: LoraConfig) -> bool:
        """An adapter of `config` fits the bank now, and no one is waiting for room (who
        would otherwise see each room they make taken by the next new model)."""
        return self.room.fits(config) and not self._admitting.locked()

    def start_parked(self, model: str) -> None:
        """A new run the bank has no room for now: parked on disk from the start, with no
        state there (a restore makes its weights from its config's seed: RestoreF). Its
        first request brings it in (`ensure_loaded`), its seq_ids from 1."""
        self.tiers.start_parked(model)
        self._store.runs.set_live(model, False, next_seq=1, idle_unloaded=True)

    def when_room(self, model: str, config: LoraConfig, tenant: str,
                  then: Callable[[Exception | None], None]) -> None:
        """Make room for a new model's adapter in the background (`make_room`, which holds
        it), then call `then(None)` (which queues its op 0: Service._open), or `then(why)`
        if no room could be made."""
        async def wait() -> None:
            try:
                await self.make_room(model, config, tenant)
            except Exception as e:  # (refused: it could never fit, or the lane went away)
                log.warning("no room for new model %s: %s", model, e)
                then(e)
                return
            then(None)

        task = asyncio.get_running_loop().create_task(wait())
        self._waiting.add(task)  # (held: a task only the loop refers to may be collected)
        task.add_done_callback(self._waiting.discard)

    async def _rebalance(self, needer: str) -> None:
        """Park the least recently used idle adapters until the bank is within budget
        (charged to `needer`, whose new adapter took the room)."""
        async with self._admitting:
            while self._over_cap(needer):  # (all its adapters busy: its next bring-in
                if not await self._park_coldest(needer=needer, only=needer):  # parks)
                    break
            while self.room.over() and not self._stopping:
                if not await self._park_coldest(needer=needer,
                                                want=self.room.used() - self.room.budget):
                    await asyncio.sleep(ROOM_POLL_S)

    async def _park_coldest(self, incoming: str | None = None, needer: Needer = None,
                            only: str | None = None, want: int = 0) -> bool:
        """Park the least recently used resident adapters with nothing queued (of tenant
        `only`, if given) until they free `want` bytes of the bank (at least one), in one
        move, to make room for `incoming` (if any); False if every one has work (or is
        being moved). One move for many: each costs the workers a round trip, which inside
        a step in flight waits for a micro-batch's end, so parking them one by one let a
        turn of 64 runs in a 1,000-run bench go at ~3 parks a second."""
        chosen, freed = [], 0
        for model in self.tiers.coldest(self._live, incoming):
            if only is not None and self._planner.queues.tenant_of(model) != only:
                continue
            lock = self._locks.setdefault(model, asyncio.Lock())
            if lock.locked() or self._planner.queues.busy(model) or not self.is_open(model):
                continue
            chosen.append(model)
            freed += self.room.held(model)
            if freed >= want:
                break
        if not chosen:
            return False
        for model in chosen:  # free: taken at once, no other task runs in between
            await self._locks[model].acquire()
        task = asyncio.get_running_loop().create_task(
            self._park_locked(chosen, incoming, needer))
        self._parking.add(task)  # (held: a task only the loop refers to may be collected)
        task.add_done_callback(self._parking.discard)
        return await asyncio.shield(task) > 0

    async def _park_locked(self, models: list[str], incoming: str | None, needer: Needer
                           ) -> int:
        """`_park_all` to host memory of `models`, whose locks the caller took: in a task
        of its own, so that a request that goes away meanwhile (its task cancelled) leaves
        no adapter half-parked, its queue closed and its state nowhere said."""
        try:
            return await self._park_all(models, to_host=True, incoming=incoming,
                                        needer=needer)
        finally:
            for model in models:
                self._locks[model].release()

    async def _park(self, model: str, to_host: bool, incoming: str | None = None,
                    needer: str | None = None) -> bool:
        """`_park_all` of one adapter: whether it left the bank."""
        return await self._park_all([model], to_host, incoming, needer) == 1

    async def _park_all(self, models: list[str], to_host: bool, incoming: str | None = None,
                        needer: Needer = None) -> int:
        """Out of the GPU bank, together (the caller holds their locks): to host memory if
        `to_host` and it has room there (the least recently parked go on to disk, never
        `incoming`, which leaves host memory next), else to disk. Their queues close; a
        next request brings each back (`ensure_loaded`). How many left the bank."""
        going: dict[str, tuple[int, int | None]] = {}  # model -> its next seq, where it resumes
        for model in models:
            next_seq = self._planner.queues.next_seq(model)
            if next_seq is None or self._planner.queues.busy(model):
                continue
            going[model] = (next_seq, self._resumes_at(model))
            self._planner.forget_model(model)
        hosted: list[str] = []
        for model in going:
            config = self._live[model]
            if to_host and await self.moves.host_room(config, incoming, needer):
                self.tiers.host.hold(model, config)  # (its room, before the next one's)
                hosted.append(model)
        errors = await self._moves(ParkF, hosted, needer)
        for model in list(hosted):
            # The worker counts its host memory as allocated (workers/parked.py: pinned
            # memory may be rounded up) and may have less room than this count says: the
            # least recently used there goes on to disk, as when this count is full, and it
            # tries again
            while (errors[model] is not None and HOST_ROOM in errors[model]
                   and await self.moves.spill_coldest(incoming, needer)):
                errors[model] = (await self.moves.move(ParkF(model), needer)).error
            if errors[model] is not None:
                log.warning("parking %s in host memory failed (%s); parking it on disk",
                            model, errors[model])
                self.tiers.host.release(model)
                hosted.remove(model)
        errors.update(await self._moves(IdleUnloadF, [m for m in going if m not in hosted],
                                        needer))
        parked = 0
        for model, (next_seq, resume) in going.items():
            if errors[model] is not None:  # still in the bank: it stays open
                log.error("parking adapter %s failed: %s", model, errors[model])
                self.open(model, self._store.runs.get(model)["tenant"], next_seq)
                continue
            self._left_bank(model, model in hosted, resume)
            parked += 1
        return parked

    async def _moves(self, frame: type, models: list[str], needer: Needer
                     ) -> dict[str, str | None]:
        """{model: why its move failed, or None} for `frame(model)` of each, in one move."""
        if not models:
            return {}
        moved = await self.moves.moves([frame(m) for m in models], needer)
        return {m: r.error for m, r in zip(models, moved, strict=True)}

    def _left_bank(self, model: str, host: bool, resume: int | None) -> None:
        """A park is done: `model` is in host memory (`host`) or on disk, and resumes at
        seq_id `resume` on its next request."""
        config = self._live.pop(model)
        if self.tiers.parked(model):
            log.warning(self.tiers.churn_warning(len(self._live)))
        self.room.release(model)
        if host:
            self.tiers.to_host(model, config)
        else:
            self.tiers.moved(model, "to_disk", config)
        self._store.runs.set_live(model, False, next_seq=resume, idle_unloaded=True)
        log.debug("adapter %s parked to %s", model, "host memory" if host else "disk")

    def _resumes_at(self, model: str) -> int | None:
        """Where a model's seq_ids go on when it comes back: the one it waits for, or None
        if it still resumes at whatever its client sends first (restored after a crash and
        not asked since: its client counted on past the state it was restored to). Kept
        across an idle unload and a hot restart, or its client's next request would wait
        forever for a seq_id the client has long used."""
        return None if self._planner.queues.resyncing(model) else self._planner.queues.next_seq(model)
