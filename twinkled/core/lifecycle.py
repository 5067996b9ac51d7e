"""The daemon's life cycle: its state, the start/drain/stop that move it, what it reports.

The service (service.py) is the daemon's commands; it composes one `LifeCycle`
(`service.life`), which every command asks before it records anything (`check_intake`),
and which the HTTP app starts and stops, healthz and the console read. The states:

    loading --loaded()--> ready --begin_stop()--> draining   (SIGTERM: the last state)
    loading --failed(e)--> failed --begin_stop()--> draining
    loading --begin_stop()--> draining

Any other move is refused (`IllegalTransition`): a stop is never undone, and a model that
finishes loading once a stop began leaves the daemon stopping. Apart from the states,
`twinkled ctl drain` pauses the intake (new work gets a 503) and resumes it.
Nothing here imports torch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from twinkled.core.futures import Futures
from twinkled.core.housekeeping import Housekeeping
from twinkled.core.lanes import Lanes
from twinkled.protocol.blobs import Blobs
from twinkled.protocol.config import Config
from twinkled.protocol.errors import Draining, UserError  # noqa: F401  (Draining re-exported)
from twinkled.store.verify import verify_checkpoints

log = logging.getLogger("twinkled")

# The states each state may move to (see the module's docstring).
_NEXT = {"loading": {"ready", "failed", "draining"}, "ready": {"draining"},
         "failed": {"draining"}, "draining": set()}


class IllegalTransition(RuntimeError):
    """A move the life cycle does not make (e.g. back out of draining): a bug, not input."""


class LifeCycle:
    def __init__(self, config: Config, store: Any, blobs: Blobs, lanes: Lanes,
                 futures: Futures, refresh_tenants: Callable[[], None]):
        """The service's parts that a start and a stop drive; `refresh_tenants`: what
        housekeeping calls to read the tenants' weights and quotas again."""
        self._config, self._store, self._blobs = config, store, blobs
        self._lanes, self._futures = lanes, futures
        self._refresh_tenants = refresh_tenants
        self._state = "loading"
        self._error: str | None = None
        self._paused = False  # `twinkled ctl drain`: new work gets a 503
        self._settled = asyncio.Event()  # set once the daemon is no longer loading
        self._polls_stopped = asyncio.Event()  # set at shutdown: long polls return at once
        self._tasks: list[asyncio.Task] = []
        self.damaged: list[dict] = []  # checkpoints found damaged at start-up

    # -- the state and its moves --------------------------------------------------------

    @property
    def state(self) -> str:
        """One of loading, ready, failed, draining (what status and the console show)."""
        return self._state

    @property
    def error(self) -> str | None:
        """Why the model failed to load (healthz says it), or None."""
        return self._error

    @property
    def stopping(self) -> bool:
        return self._state == "draining"

    @property
    def serving(self) -> bool:
        """Loaded and taking work (idle adapters may leave, lanes may be balanced)."""
        return self._state == "ready" and not self._paused

    def loaded(self) -> None:
        self._move("ready")
        log.info("model %s loaded", self._config.served_name)

    def failed(self, error: str) -> None:
        """The model did not load: the daemon keeps answering healthz with `error`."""
        self._move("failed")
        self._error = error

    def begin_stop(self) -> None:
        """SIGTERM: no new work from now on, ever."""
        self._move("draining")

    def pause_intake(self) -> None:
        self._paused = True

    def resume_intake(self) -> None:
        self._paused = False

    def _move(self, to: str) -> None:
        if to not in _NEXT[self._state]:
            raise IllegalTransition(f"the daemon does not go from {self._state} to {to}")
        self._state = to
        self._settled.set()  # (every move leaves "loading" or was made after it)

    async def settled(self) -> None:
        """Wait until the model is loaded (or failed to load, or a stop began)."""
        await self._settled.wait()

    def stop_polls(self) -> None:
        """Long polls return at once from now on (their clients poll again, elsewhere)."""
        self._polls_stopped.set()

    async def polls_stopped(self) -> None:
        await self._polls_stopped.wait()

    # -- what the daemon takes and reports ----------------------------------------------

    def check_intake(self) -> None:
        """Raise if the daemon takes no work now: a command asks this before it records
        anything, so that a refusal (a 503 the client retries) leaves nothing behind."""
        if self._state == "failed":
            raise UserError(f"the model failed to load: {self._error}")
        if self._state == "draining" or self._paused:
            raise Draining("the daemon is draining for maintenance or a restart; retry shortly")
        if not self._lanes.up():  # (a head with no workers of its own: remote_lanes.py)
            raise Draining("no lane is up: no host that brings lanes is joined; retry shortly")

    def check_loaded(self, model_id: str | None) -> None:
        """A hot restart: the run comes back once the model is loaded, so its client's
        requests meanwhile get a 503 they retry, not the 400 of a run not here."""
        if self._state == "loading" and model_id is not None and \
                not self._lanes.is_open(model_id):
            raise Draining("the daemon is starting (loading the model, restoring adapters); "
                           "retry shortly")

    @property
    def health(self) -> str:
        """healthz's status: "ok" when requests run now ("restarting" while workers do)."""
        if self._state == "ready" and self._lanes.recovering:
            return "restarting"
        if self._state == "ready" and self._paused:
            return "draining"
        return "ok" if self._state == "ready" else self._state

    def status(self) -> dict:
        return {"model": self._config.served_name, "state": self._state,
                **self._lanes.status(), "damaged_checkpoints": self.damaged,
                "time": time.time()}

    def gauges(self) -> dict:
        """What /metrics reads at scrape time."""
        lanes = self._lanes
        queued = {t: s["queued_requests"] for t, s in lanes.tenant_status().items()}
        return {"queued": queued, "adapters": lanes.model_count(), "workers": lanes.workers(),
                "up": self.health == "ok", "logprob_gap": lanes.logprob_gap(),
                "tiers": lanes.tiers()}

    # -- start, drain, stop -------------------------------------------------------------

    async def start(self, housekeeping: bool = True) -> None:
        """Start the workers (they load the model); the HTTP server answers meanwhile.

        Work cut short by the last stop is settled first: its futures fail with a clear
        error when polled, and half-written checkpoints are marked and never served."""
        self._lanes.settle_last_stop()
        self._advertise()
        loop = asyncio.get_running_loop()
        # Hashing can take a while on a big data dir: in a thread, while the workers load
        # the model and the HTTP server answers; no step runs before it is done.
        self._verified = loop.run_in_executor(None, verify_checkpoints, self._store,
                                              self._config.data_dir, self._blobs)
        self._tasks.append(loop.create_task(self._run()))
        if housekeeping:
            chores = Housekeeping(self._config, self._store, self._futures, self._lanes,
                                  blobs=self._blobs, status=self.status,
                                  refresh_tenants=self._refresh_tenants,
                                  may_unload=lambda: self.serving)
            self._tasks.append(loop.create_task(chores.run()))

    def _advertise(self) -> None:
        """<data_dir>/daemon.json tells `twinkled ctl` where this daemon answers."""
        config = self._config
        host = config.host if config.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        info = {"url": f"http://{host}:{config.port}", "pid": os.getpid()}
        (config.data_dir / "daemon.json").write_text(json.dumps(info))

    async def _run(self) -> None:
        await self._load()
        try:
            self.damaged = await self._verified
        except Exception:  # a verification bug must not stop the daemon from serving
            log.exception("verifying checkpoints failed")
        await self._lanes.run()

    async def _load(self) -> None:
        """Start the worker groups (they load the model) and bring back the live adapters."""
        try:
            await self._lanes.start()
            loop = asyncio.get_running_loop()
            self._tasks += [loop.create_task(w) for w in self._lanes.watchers()]
        except Exception as e:  # the daemon keeps answering healthz with the reason
            log.exception("model load failed")
            if not self.stopping:
                self.failed(f"{type(e).__name__}: {e}")
            return
        if not self.stopping:  # (a stop that began meanwhile stands)
            self.loaded()

    async def _until_idle(self, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self._lanes.idle() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return self._lanes.idle()

    async def shutdown(self) -> None:
        """SIGTERM: stop taking work, let queued work run (up to `drain_timeout_s`), fail
        the rest, persist every live adapter with its optimizer state, stop the workers."""
        self.begin_stop()
        await self._until_idle(self._config.drain_timeout_s)
        self._cancel_tasks()
        self._futures.fail_unfinished("the daemon was stopped (restarted) before this "
                                      "request ran; submit it again", "server")
        self.stop_polls()
        if self._error is None and self._lanes.model_info():
            try:
                live = await self._lanes.persist_all()
                log.info("persisted %d live adapter(s)", live)
            except Exception:
                log.exception("persisting live adapters at shutdown failed")
        await self._lanes.stop()
        (self._config.data_dir / "daemon.json").unlink(missing_ok=True)
        log.info("workers stopped; closing connections")

    async def drain(self, timeout: float = 600.0, undo: bool = False) -> dict:
        """`twinkled ctl drain`: stop taking new work and wait (up to `timeout`) until
        nothing queued can run; `undo`: take work again."""
        if undo:
            self.resume_intake()
            return {"drained": False, "queued": 0}
        self.pause_intake()
        drained = await self._until_idle(timeout)
        queued = sum(t["queued_requests"] for t in self._lanes.tenant_status().values())
        return {"drained": drained, "queued": queued}

    def _cancel_tasks(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def close(self) -> None:
        self._cancel_tasks()
        if not self.stopping:
            await self._lanes.stop()
