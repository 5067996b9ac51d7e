"""The daemon's chores on a timer: tenant settings and the status row every few seconds,
old results and expired checkpoints every minute, adapters idle for `idle_unload_s` out of
the workers' memory, idle runs moved between lanes that fill unevenly. A chore that fails is logged and tried again at the next tick."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from twinkled.core.balance import balance
from twinkled.core.futures import Futures
from twinkled.protocol.blobs import Blobs
from twinkled.protocol.config import Config

log = logging.getLogger("twinkled")


class Idle(Protocol):
    """Who unloads idle adapters (the lanes, each asking its residency), and moves runs
    between lanes to balance them (core/balance.py)."""

    async def unload_idle(self, idle_s: float) -> None: ...



class Housekeeping:
    def __init__(self, config: Config, store, futures: Futures, adapters: Idle, *,
                 blobs: Blobs, status: Callable[[], dict], refresh_tenants: Callable[[], None],
                 may_unload: Callable[[], bool]):
        """`blobs`: where checkpoint files live (the service's); `status`: the row
        `twinkled ctl status` reads; `may_unload`: whether idle adapters may leave now (not
        while loading or draining)."""
        self._config, self._store, self._blobs = config, store, blobs
        self._futures, self._adapters = futures, adapters
        self._status, self._refresh_tenants = status, refresh_tenants
        self._may_unload = may_unload

    async def run(self, every: float = 2.0) -> None:
        ticks = 0
        while True:
            try:
                self.tick(minute=ticks % 30 == 0)
            except Exception:  # housekeeping must never take the daemon down
                log.exception("housekeeping failed")
            try:
                await self.unload_idle()
            except Exception:
                log.exception("unloading idle adapters failed")
            try:
                if self._may_unload():
                    await balance(self._adapters)  # (balance.py)
            except Exception:
                log.exception("balancing the lanes failed")
            ticks += 1
            await asyncio.sleep(every)

    def tick(self, minute: bool = False) -> None:
        self._refresh_tenants()
        self._store.status.put(self._status())
        if minute:
            self._futures.purge()
            for c in self._store.checkpoints.expired():
                self._store.checkpoints.delete(c["tinker_path"])
                self._blobs.delete_later(c["dir"])
                log.info("checkpoint %s expired and was deleted", c["tinker_path"])

    async def unload_idle(self) -> None:
        """Adapters idle for `idle_unload_s` leave the workers' memory (Residency)."""
        limit = self._config.idle_unload_s
        if limit > 0 and self._may_unload():
            await self._adapters.unload_idle(limit)
