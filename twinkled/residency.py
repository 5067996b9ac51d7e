"""Which adapters are in the workers' memory: brought back at start-up, unloaded when idle,
reloaded on their next request. A mixin of the Service (`self.store`, `self.planner`,
`self.workers`, `self.config`)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from .engine.types import LoraConfig
from .futures import UserError

log = logging.getLogger("twinkled")


def _config(run: dict) -> LoraConfig:
    return LoraConfig(**{k: v for k, v in (run["lora_config"] or {}).items()
                         if k in LoraConfig.__dataclass_fields__})


class Residency:
    store: Any
    planner: Any
    workers: Any
    config: Any
    state: str
    intake_paused: bool
    _model_locks: dict[str, asyncio.Lock]

    async def _restore_runs(self) -> None:
        """Adapters live at the last stop, from their persisted state. After a hot restart
        their seq_ids continue exactly; after a crash the first request resumes them."""
        runs = self.store.live_runs()
        configs = {r["id"]: _config(r) for r in runs}
        failed = await self.workers.restore(configs)
        for r in runs:
            if r["id"] in failed:
                log.error("run %s could not be restored: %s", r["id"], failed[r["id"]])
                self.store.set_run_live(r["id"], False)
                continue
            self.planner.open_model(r["id"], r["tenant"], r["next_seq"] or 1,
                                    resync=r["next_seq"] is None)
            self.store.set_run_live(r["id"], True)  # forget next_seq: a crash resyncs
        if runs:
            log.info("restored %d adapter(s)", len(runs) - len(failed))

    async def _unload_idle(self) -> None:
        """Free the memory of adapters idle for `idle_unload_s` (clients that went away
        without finishing their session). They are persisted first and come back, at the
        same weights and seq_ids, on their next request (`ensure_loaded`)."""
        limit = self.config.idle_unload_s
        if limit <= 0 or self.state != "ready" or self.intake_paused:
            return
        for run in self.store.idle_runs(time.time() - limit):
            model = run["id"]
            async with self._model_locks.setdefault(model, asyncio.Lock()):
                q = self.planner.models.get(model)
                if q is None or q.pending or q.in_flight:
                    continue
                next_seq = q.next_seq
                self.planner.forget_model(model)
                try:
                    await self.workers.unload_idle(model)
                except Exception:  # the group restarts and restores it: keep it loaded
                    log.exception("unloading idle adapter %s failed", model)
                    self.planner.open_model(model, run["tenant"], next_seq)
                    continue
                self.store.set_run_live(model, False, next_seq=next_seq, idle_unloaded=True)
                log.info("adapter %s unloaded after %.0f s idle", model, limit)

    async def ensure_loaded(self, run: dict) -> None:
        """Bring back an adapter unloaded while idle, before a request for it is queued."""
        model = run["id"]
        if model in self.planner.models:
            return
        async with self._model_locks.setdefault(model, asyncio.Lock()):
            fresh = self.store.get_run(model)
            if model in self.planner.models or not (fresh and fresh["idle_unloaded"]):
                return  # loaded meanwhile, or never unloaded (submit says why not loaded)
            why = await self.workers.restore_one(model, _config(fresh))
            if why is not None:
                raise UserError(f"model {model} was unloaded while idle and could not be "
                                f"reloaded: {why}")
            self.planner.open_model(model, fresh["tenant"], fresh["next_seq"] or 1,
                                    resync=fresh["next_seq"] is None)
            self.store.set_run_live(model, True)
            log.info("adapter %s reloaded after being idle", model)

