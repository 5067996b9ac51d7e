"""The sessions table and what is read per session (search, trace, storage). Part of the
Store (a mixin over its connection and helpers, like `store_futures`)."""

from __future__ import annotations

import uuid
from typing import Any

from .schema import Row, now, to_json


class SessionRows:
    _lock: Any
    conn: Any
    _all: Any
    _one: Any
    _write: Any
    _insert: Any
    _page: Any

    def create_session(self, tenant: str, user_metadata: dict | None = None,
                       sdk_version: str | None = None, display_name: str | None = None) -> str:
        sid, t = f"sess-{uuid.uuid4().hex}", now()
        self._insert("sessions", {"id": sid, "tenant": tenant, "created": t,
                                  "last_heartbeat": t, "finished_at": None,
                                  "user_metadata": to_json(user_metadata),
                                  "sdk_version": sdk_version, "display_name": display_name})
        return sid

    def heartbeat(self, session_id: str) -> bool:
        return self._write("UPDATE sessions SET last_heartbeat = ? WHERE id = ?",
                           (now(), session_id)) > 0

    def finish_session(self, session_id: str, reason: str | None = None) -> bool:
        """Mark it finished, with the client's reason (success, errored, interrupted)."""
        return self._write("UPDATE sessions SET finished_at = ?, finish_reason = ? WHERE id = ? "
                           "AND finished_at IS NULL", (now(), reason, session_id)) > 0

    def get_session(self, session_id: str) -> Row | None:
        return self._one("SELECT * FROM sessions WHERE id = ?", [session_id])

    def list_sessions(self, tenant: str, offset: int = 0,
                      limit: int = 20) -> tuple[list[Row], int]:
        return self._page("tenant = ?", [tenant], "sessions", offset, limit)

    def session_children(self, session_id: str) -> tuple[list[str], list[str]]:
        """(training run ids, sampler ids) of a session, for GET /sessions/{id}."""
        runs = self._all("SELECT id FROM runs WHERE session_id = ? AND NOT deleted "
                         "ORDER BY rowid", [session_id])
        samplers = self._all("SELECT id FROM samplers WHERE session_id = ? ORDER BY rowid",
                             [session_id])
        return [r["id"] for r in runs], [s["id"] for s in samplers]

    def sessions_before(self, tenant: str, cursor: tuple[int, str] | None,
                        limit: int) -> list[Row]:
        """A tenant's sessions, newest first, strictly after `cursor` in that order.

        The cursor is (created in whole microseconds, session id): what a REST cursor carries
        as a datetime (microsecond precision), so a page never repeats or skips a row."""
        key = "CAST(round(created * 1000000) AS INTEGER)"
        where, params = "tenant = ?", [tenant]
        if cursor is not None:
            where += f" AND ({key} < ? OR ({key} = ? AND id < ?))"
            params += [cursor[0], cursor[0], cursor[1]]
        return self._all(f"SELECT *, {key} AS created_us FROM sessions WHERE {where} "
                         "ORDER BY created_us DESC, id DESC LIMIT ?", [*params, limit])

    def session_checkpoints(self, session_ids: list[str]) -> dict[str, tuple[int, int]]:
        """session id -> (ready checkpoints, their bytes) of the runs it created."""
        if not session_ids:
            return {}
        marks = ",".join("?" * len(session_ids))
        rows = self._all("SELECT r.session_id AS sid, count(*) AS n, "
                         "coalesce(sum(c.size_bytes), 0) AS bytes FROM checkpoints c "
                         "JOIN runs r ON r.id = c.run_id WHERE c.status = 'ready' AND "
                         f"r.session_id IN ({marks}) GROUP BY r.session_id", session_ids)
        return {r["sid"]: (r["n"], r["bytes"]) for r in rows}

    def checkpoint_usage(self, tenant: str) -> tuple[int, int]:
        """(ready checkpoints, their bytes) of a tenant: what it can list and delete."""
        row = self._one("SELECT count(*) AS n, coalesce(sum(size_bytes), 0) AS bytes FROM "
                        "checkpoints WHERE tenant = ? AND status = 'ready'", [tenant])
        return row["n"], row["bytes"]

    def session_trace_rows(self, session_id: str) -> dict[str, list[Row]]:
        """What a session's trace is built from: its runs (deleted ones too: they happened),
        samplers, the checkpoints of its runs, and the futures still held of both."""
        runs = self._all("SELECT * FROM runs WHERE session_id = ? ORDER BY created", [session_id])
        samplers = self._all("SELECT * FROM samplers WHERE session_id = ? ORDER BY created",
                             [session_id])
        checkpoints = self._all("SELECT c.tinker_path, c.run_id, c.kind, c.name, c.status, "
                                "c.size_bytes, c.created FROM checkpoints c JOIN runs r ON "
                                "r.id = c.run_id WHERE r.session_id = ? ORDER BY c.created",
                                [session_id])
        owners = [r["id"] for r in runs] + [s["id"] for s in samplers]
        futures: list[Row] = []
        for i in range(0, len(owners), 500):  # SQLite's bound on parameters per statement
            part = owners[i:i + 500]
            futures += self._all("SELECT id, kind, model_id, status, created, completed_at "
                                 f"FROM futures WHERE model_id IN ({','.join('?' * len(part))})",
                                 part)
        futures.sort(key=lambda f: f["created"])
        return {"runs": runs, "samplers": samplers, "checkpoints": checkpoints,
                "futures": futures}
