"""Futures: what a client polls for the result of an operation that runs later.

A future lives in memory while it is wanted and in the store for good (a restart keeps the
results, and turns the ones it cut short into clear errors). `Futures` is the one place
that makes, settles and finds them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twinkled.protocol.errors import NotFound

log = logging.getLogger("twinkled")

# encode(result) -> (payload bytes, content type); chosen by the protocol layer at submit.
Encoder = Callable[[Any], tuple[bytes, str]]


@dataclass
class Future:
    id: str
    tenant: str
    kind: str
    encode: Encoder
    done: asyncio.Event = field(default_factory=asyncio.Event)
    payload: bytes | None = None
    content_type: str = "application/json"
    error: tuple[str, str] | None = None  # (message, category)
    completed_at: float | None = None
    owner: str | None = None  # the run or sampler it belongs to, written when it settles


def empty_json(_: Any) -> tuple[bytes, str]:
    """The encoder of futures whose result nobody reads (an unload, a refusal)."""
    return b"{}", "application/json"


class Futures:
    """The futures of this daemon's requests, mirrored to the store's `futures` table."""

    def __init__(self, store: Any):
        self._store = store
        self._live: dict[str, Future] = {}

    def new(self, tenant: str, kind: str, encode: Encoder, run: str | None = None) -> Future:
        """`run`: the training run it is for, recorded at once (a restart after a crash
        must know which runs had a forward_backward cut short: core.py, `cut_short`)."""
        f = Future(f"req-{uuid.uuid4().hex}", tenant, kind, encode)
        self._live[f.id] = f
        self._store.futures.create(f.id, tenant, kind, model_id=run)
        return f

    def bind(self, f: Future, model: str, seq_id: int) -> None:
        """`f` took op `seq_id` of `model` (recorded, so that a retry after a crash of the
        daemon gets `f`, not a second run of the op)."""
        self._store.futures.bind(f.id, model, seq_id)

    def taken(self, tenant: str, model: str, seq_id: int, kind: str) -> Future | None:
        """The future of a `kind` request recorded for op `seq_id` of `model`, if any (from
        before a restart too); None if none, or if it is still pending in the store (cut
        short by a crash and not yet settled: start-up fails those first)."""
        future_id = self._store.futures.find(model, seq_id, kind)
        if future_id is None:
            return None
        try:
            return self.get(tenant, future_id)
        except NotFound:
            return None

    @contextlib.contextmanager
    def settling(self):
        """Settle a step's futures in one store transaction: one commit per step, not one
        per request (the event loop's main SQLite cost with many tenants)."""
        with self._store.db.transaction():
            yield

    def tag(self, future_id: str, owner: str) -> None:
        """Record which run or sampler a future belongs to, so a session's trace shows it:
        kept on a live pending future and written with its result (no write of its own)."""
        f = self._live.get(future_id)
        if f is not None and not f.done.is_set():
            f.owner = f.owner or owner
        else:
            self._store.futures.tag(future_id, owner)

    def resolve(self, f: Future, result: Any) -> None:
        try:
            f.payload, f.content_type = f.encode(result)
        except Exception as e:  # an encoder bug must not leave the client polling forever
            log.exception("encoding a %s result failed", f.kind)
            return self.fail(f, f"server error encoding the result: {e}", "server")
        f.completed_at = time.time()
        self._store.futures.complete(f.id, f.payload, f.content_type, f.owner)
        f.done.set()

    def fail(self, f: Future, message: str, category: str) -> None:
        f.error = (message, category)
        f.completed_at = time.time()
        self._store.futures.fail(f.id, message, category, f.owner)
        f.done.set()

    def drop(self, f: Future, why: str) -> None:
        """A future whose request was refused at submit (the client heard why as a 4xx):
        never polled, so it is only recorded as failed."""
        self._live.pop(f.id, None)
        self._store.futures.fail(f.id, why, "user")

    def fail_unfinished(self, message: str, category: str) -> None:
        for f in list(self._live.values()):
            if not f.done.is_set():
                self.fail(f, message, category)

    def find(self, future_id: str) -> Future | None:
        """A live future by id, whoever owns it (for the daemon's own bookkeeping)."""
        return self._live.get(future_id)

    def get(self, tenant: str, future_id: str) -> Future:
        """A tenant's future: a live one, or one from before a restart (from the store)."""
        f = self._live.get(future_id)
        if f is None:
            row = self._store.futures.get(future_id)
            if row is not None and row["status"] != "pending":
                f = Future(row["id"], row["tenant"], row["kind"], encode=None)
                f.payload, f.content_type = row["result"], row["content_type"]
                if row["status"] == "error":
                    body = json.loads(row["result"])
                    f.error = (body["error"], body["category"])
                f.done.set()
        if f is None or f.tenant != tenant:  # another tenant's id is simply not found
            raise NotFound(f"no request {future_id!r}")
        return f

    def purge(self, keep_seconds: float = 600.0) -> None:
        """Forget results older than `keep_seconds` (at least 5 minutes after completion)."""
        cutoff = time.time() - keep_seconds
        for fid in [k for k, f in self._live.items() if f.completed_at and f.completed_at < cutoff]:
            del self._live[fid]
        self._store.futures.purge(keep_seconds)

    def __len__(self) -> int:
        return len(self._live)
