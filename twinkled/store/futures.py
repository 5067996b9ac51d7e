"""The futures table (``store.futures``): a client's poll target for an operation that
finishes later. `twinkled.core.futures.Futures` keeps the live ones in memory and their rows here,
so a result can still be read after a restart."""

from __future__ import annotations

import json

from twinkled.store.db import Db
from twinkled.store.schema import MIN_FUTURE_TTL_S, Row, error_body, now


class FutureRows:
    """The futures table: pending, then resolved once (done or error), purged later."""

    def __init__(self, db: Db) -> None:
        self._db = db

    def create(self, future_id: str, tenant: str, kind: str,
               model_id: str | None = None, seq_id: int | None = None) -> str:
        """Record a pending future. If (model_id, seq_id) already has one, this is a
        client retry: nothing is created and the original id is returned."""
        with self._db.transaction() as conn:
            if model_id is not None and seq_id is not None:
                existing = self.find(model_id, seq_id)
                if existing is not None:
                    return existing
            conn.execute("INSERT INTO futures (id, tenant, kind, model_id, seq_id, "
                         "status, created) VALUES (?, ?, ?, ?, ?, 'pending', ?)",
                         (future_id, tenant, kind, model_id, seq_id, now()))
        return future_id

    def complete(self, future_id: str, result: bytes, content_type: str,
                 owner: str | None = None) -> bool:
        """Store the encoded result (JSON or protobuf bytes), and the run or sampler it
        belongs to if known (`tag`). The first resolution wins: returns False if the future
        is unknown or already resolved."""
        return self._db.write("UPDATE futures SET status = 'done', result = ?, "
                              "content_type = ?, completed_at = ?, "
                              "model_id = COALESCE(model_id, ?) WHERE id = ? AND "
                              "status = 'pending'",
                              (result, content_type, now(), owner, future_id)) > 0

    def fail(self, future_id: str, message: str, category: str = "server",
             owner: str | None = None) -> bool:
        """Resolve with ``{"error", "category"}`` (category "user" or "server")."""
        return self._db.write("UPDATE futures SET status = 'error', result = ?, "
                              "content_type = 'application/json', completed_at = ?, "
                              "model_id = COALESCE(model_id, ?) "
                              "WHERE id = ? AND status = 'pending'",
                              (error_body(message, category), now(), owner, future_id)) > 0

    def tag(self, future_id: str, owner_id: str) -> bool:
        """Record the run or sampler a future belongs to (once), so that its session's trace
        shows it. seq_id stays NULL: the (model_id, seq_id) index of retries is unaffected."""
        return self._db.write("UPDATE futures SET model_id = ? WHERE id = ? AND model_id IS NULL",
                              (owner_id, future_id)) > 0

    def bind(self, future_id: str, model_id: str, seq_id: int) -> None:
        """Record that the future took op `seq_id` of `model_id`: a client's retry of it,
        even after a crash of the daemon, finds the original (`find`)."""
        with self._db.transaction() as conn:
            # A future of another kind cut short by a crash may hold it: a new request
            # (a retry is of the same kind, and gets that future: `find`).
            conn.execute("UPDATE futures SET seq_id = NULL WHERE model_id = ? AND seq_id = ? "
                         "AND id != ?", (model_id, seq_id, future_id))
            conn.execute("UPDATE futures SET model_id = ?, seq_id = ? WHERE id = ?",
                         (model_id, seq_id, future_id))

    def get(self, future_id: str) -> Row | None:
        return self._db.one("SELECT * FROM futures WHERE id = ?", [future_id])

    def find(self, model_id: str, seq_id: int, kind: str | None = None) -> str | None:
        """The future already submitted for (model_id, seq_id) (of `kind`), if any."""
        row = self._db.one("SELECT id, kind FROM futures WHERE model_id = ? AND seq_id = ?",
                           [model_id, seq_id])
        return row["id"] if row and kind in (None, row["kind"]) else None

    def failed_training(self) -> list[tuple[str, int, str, str]]:
        """(run, seq_id, error, category) of each run whose latest forward_backward or
        optim_step is a forward_backward that failed (at start-up, after `fail_pending`:
        the optim_step its client sent behind it was not received, and a resend of it must
        not run without those gradients; core/lost_gradients.py). Forward-only requests
        are futures of kind "forward" and lose no gradients."""
        rows = self._db.all(
            "SELECT f.model_id, f.seq_id, f.result FROM futures f JOIN "
            "(SELECT model_id, MAX(seq_id) AS last FROM futures WHERE seq_id IS NOT NULL "
            "AND kind IN ('forward_backward', 'optim_step') GROUP BY model_id) m "
            "ON f.model_id = m.model_id AND f.seq_id = m.last "
            "WHERE f.kind = 'forward_backward' AND f.status = 'error'")
        out = []
        for r in rows:
            body = json.loads(r["result"])
            out.append((r["model_id"], r["seq_id"], body["error"], body["category"]))
        return out

    def pending_ids(self) -> set[str]:
        """The ids of the pending futures (at start-up: what a crash cut short)."""
        return {r["id"] for r in self._db.all("SELECT id FROM futures WHERE status = 'pending'")}

    def fail_pending(self, message: str) -> int:
        """At start-up: futures a crash left pending fail with a server error (the client
        would otherwise poll them forever). Returns how many."""
        return self._db.write("UPDATE futures SET status = 'error', result = ?, "
                              "content_type = 'application/json', completed_at = ? "
                              "WHERE status = 'pending'", (error_body(message, "server"), now()))

    def purge(self, older_than_seconds: float, at: float | None = None) -> int:
        """Delete resolved futures completed more than older_than_seconds ago (never less
        than MIN_FUTURE_TTL_S, so a client may still re-read a result). Returns how many."""
        cutoff = (now() if at is None else at) - max(older_than_seconds, MIN_FUTURE_TTL_S)
        return self._db.write("DELETE FROM futures WHERE status != 'pending' AND "
                              "completed_at < ?", (cutoff,))
