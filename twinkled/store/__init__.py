"""Persistence for the daemon: one SQLite file (WAL) through ``sqlite-utils``.

What survives a restart lives here: tenants and hashed API keys, sessions, training runs,
checkpoints, samplers and futures. Calls are short synchronous queries made directly from
the asyncio main process, so nothing here imports torch or blocks for long. The store does
not enforce ownership (the service layer does), but every owned row records its ``tenant``.

``Store`` is the composition: one ``Db`` (db.py: connection, lock, schema) shared by an
object per table group, reached as attributes so a call site names what it touches:
``store.tenants`` (store_tenants.py), ``store.status`` (the daemon's status row),
``store.sessions`` (store_sessions.py), ``store.runs`` and ``store.samplers``
(store_runs.py), ``store.checkpoints`` (store_checkpoints.py), ``store.futures``
(store_futures.py), ``store.steps`` (each run's step metrics: steps.py) and
``store.client_metrics`` (what clients report of their runs: steps.py).

Conventions: times are unix seconds (floats; ``to_datetime`` turns them into the UTC
datetimes REST objects need); rows come back as plain dicts with JSON columns decoded and
flag columns as bools; ``get`` returns None for a missing row; mutators return whether a
row matched, so the caller can answer 404.
"""

from __future__ import annotations

from pathlib import Path

from twinkled.store.checkpoints import Checkpoints
from twinkled.store.db import Db
from twinkled.store.futures import FutureRows
from twinkled.store.runs import Runs, Samplers
from twinkled.store.schema import Row, to_datetime  # noqa: F401 - the store's API
from twinkled.store.sessions import Sessions
from twinkled.store.steps import ClientMetrics, Steps
from twinkled.store.tenants import StatusRow, Tenants


class Store:
    """The daemon's SQLite database. Safe to share between threads (one lock, one conn)."""

    def __init__(self, path: Path | str) -> None:
        self.db = Db(path)
        self.tenants = Tenants(self.db)
        self.status = StatusRow(self.db)
        self.sessions = Sessions(self.db)
        self.runs = Runs(self.db, self.sessions)
        self.samplers = Samplers(self.db, self.sessions)
        self.checkpoints = Checkpoints(self.db, self.tenants)
        self.futures = FutureRows(self.db)
        self.steps = Steps(self.db)
        self.client_metrics = ClientMetrics(self.db)

    def close(self) -> None:
        self.db.close()
