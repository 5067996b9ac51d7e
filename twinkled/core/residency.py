"""Residency: the one owner of adapter liveness.

Which training adapters the workers hold (with the config a restore re-creates them from),
which models accept operations (their queue in the planner), and the store's `live` flag
that brings them back after a restart: all three change here and only here. Adapters are
restored at start-up, unloaded when idle (persisted first), and reloaded on their next
request. The executor asks `live_configs` when a restarted worker group must get them back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from scheduler import Planner
from twinkled.core.adapter_room import AdapterRoom
from twinkled.core.executor import Executor
from twinkled.core.ops import Outcome
from twinkled.protocol.errors import UserError
from twinkled.protocol.frames import CreateF, LoadF, OpF, UnloadF
from twinkled.protocol.types import (
    ATTN_MODULES,
    MLP_MODULES,
    UNEMBED_MODULES,
    AdapterInfo,
    LoraConfig,
)

log = logging.getLogger("twinkled")


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
                 room: AdapterRoom | None = None):
        self._store = store
        self._planner = planner
        self._executor = executor
        self.room = room or AdapterRoom(None, lambda _: 0)  # GPU memory for adapters
        self._live: dict[str, LoraConfig] = {}  # training adapters in the workers' memory
        self._locks: dict[str, asyncio.Lock] = {}  # idle unload vs reload of one model

    # -- what is live -------------------------------------------------------------------

    def is_open(self, model: str) -> bool:
        """The model takes operations (created, restored or reloaded; not yet closed)."""
        return self._planner.has_model(model)

    def live_configs(self) -> dict[str, LoraConfig]:
        return dict(self._live)

    def count(self) -> int:
        return len(self._live)

    # -- what steps did -----------------------------------------------------------------

    def open(self, model: str, tenant: str, first_seq: int = 1, resync: bool = False) -> None:
        """A model starts taking operations, from `first_seq` (its create or load is op 0)."""
        self._planner.open_model(model, tenant, first_seq, resync=resync)

    def note(self, frame: OpF, outcome: Outcome) -> None:
        """What an op that ran changed: a created or loaded adapter is live (a restart
        brings it back); an unloaded one is not."""
        result, error, _ = outcome
        model = frame.adapter_id
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
        configs = {r["id"]: stored_config(r) for r in runs}
        failed = await self._executor.restore(configs)
        for r in runs:
            if r["id"] in failed:
                log.error("run %s could not be restored: %s", r["id"], failed[r["id"]])
                self._store.runs.set_live(r["id"], False)
                continue
            self._live[r["id"]] = configs[r["id"]]
            self.room.hold(r["id"], configs[r["id"]])  # what was live comes back, room or not
            self.open(r["id"], r["tenant"], r["next_seq"] or 1, resync=r["next_seq"] is None)
            self._store.runs.set_live(r["id"], True)  # forget next_seq: a crash resyncs
        if runs:
            log.info("restored %d adapter(s)", len(runs) - len(failed))

    async def unload_idle(self, idle_s: float) -> None:
        """Free the memory of adapters idle for `idle_s` (clients that went away without
        finishing their session). They are persisted first and come back, at the same
        weights and seq_ids, on their next request (`ensure_loaded`)."""
        for run in self._store.runs.idle(time.time() - idle_s):
            model = run["id"]
            async with self._locks.setdefault(model, asyncio.Lock()):
                next_seq = self._planner.next_seq(model)
                if next_seq is None or self._planner.busy(model):
                    continue
                resume = self._resumes_at(model)
                self._planner.forget_model(model)
                try:
                    await self._executor.unload_idle(model)
                except Exception:  # the group restarts and restores it: keep it loaded
                    log.exception("unloading idle adapter %s failed", model)
                    self.open(model, run["tenant"], next_seq)
                    continue
                self._live.pop(model, None)
                self.room.release(model)
                self._store.runs.set_live(model, False, next_seq=resume, idle_unloaded=True)
                log.info("adapter %s unloaded after %.0f s idle", model, idle_s)

    async def ensure_loaded(self, run: dict) -> None:
        """Bring back an adapter unloaded while idle, before a request for it is queued."""
        model = run["id"]
        if self.is_open(model):
            return
        async with self._locks.setdefault(model, asyncio.Lock()):
            fresh = self._store.runs.get(model)
            if self.is_open(model) or not (fresh and fresh["idle_unloaded"]):
                return  # loaded meanwhile, or never unloaded (submit says why not loaded)
            config = stored_config(fresh)
            self.room.admit(model, config)
            why = await self._executor.restore_one(model, config)
            if why is not None:
                self.room.release(model)
                raise UserError(f"model {model} was unloaded while idle and could not be "
                                f"reloaded: {why}")
            self._live[model] = config
            self.open(model, fresh["tenant"], fresh["next_seq"] or 1,
                      resync=fresh["next_seq"] is None)
            self._store.runs.set_live(model, True)
            log.info("adapter %s reloaded after being idle", model)

    async def persist_all(self) -> int:
        """Every live adapter on disk, and where each model's seq_ids go on (a hot restart
        continues them exactly). Returns how many adapters were live."""
        await self._executor.persist_all()
        for model in self._planner.model_seqs():
            self._store.runs.set_live(model, True, next_seq=self._resumes_at(model))
        return len(self._live)

    def _resumes_at(self, model: str) -> int | None:
        """Where a model's seq_ids go on when it comes back: the one it waits for, or None
        if it still resumes at whatever its client sends first (restored after a crash and
        not asked since: its client counted on past the state it was restored to). Kept
        across an idle unload and a hot restart, or its client's next request would wait
        forever for a seq_id the client has long used."""
        return None if self._planner.resyncing(model) else self._planner.next_seq(model)
