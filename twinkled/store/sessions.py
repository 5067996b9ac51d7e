"""The sessions table (``store.sessions``): a client's sessions, the per-session counters
that number its runs and samplers, and what is read per session (search, trace, storage)."""

from __future__ import annotations

import uuid

from twinkled.store.db import Db
from twinkled.store.schema import Row, now, to_json


class Sessions:
    """The sessions table, and the reads that join a session's runs, samplers and futures."""

    def __init__(self, db: Db) -> None:
        self._db = db

    def create(self, tenant: str, user_metadata: dict | None = None,
               sdk_version: str | None = None, display_name: str | None = None) -> str:
        sid, t = f"sess-{uuid.uuid4().hex}", now()
        self._db.insert("sessions", {"id": sid, "tenant": tenant, "created": t,
                                     "last_heartbeat": t, "finished_at": None,
                                     "user_metadata": to_json(user_metadata),
                                     "sdk_version": sdk_version, "display_name": display_name})
        return sid

    def open_count(self, tenant: str, since: float) -> int:
        """The tenant's sessions not finished and heard from (created or heartbeat) since
        `since`: what counts against tenant_max_sessions."""
        row = self._db.one("SELECT count(*) AS n FROM sessions WHERE tenant = ? AND "
                           "finished_at IS NULL AND last_heartbeat >= ?", [tenant, since])
        return int(row["n"]) if row else 0

    def next_model_seq(self, session_id: str, claim: int | None = None) -> int:
        """0, 1, 2 ... per session: the ``<n>`` of ``<session_id>:train:<n>``."""
        return self._next_seq("model_seq", session_id, claim)

    def next_sampler_seq(self, session_id: str, claim: int | None = None) -> int:
        """0, 1, 2 ... per session: the ``<n>`` of ``<session_id>:sample:<n>``."""
        return self._next_seq("sampler_seq", session_id, claim)

    def _next_seq(self, col: str, session_id: str, claim: int | None) -> int:
        """Hand out the next counter value (atomic, one UPDATE ... RETURNING), or, when the
        client chose the number itself (``claim``), move the counter past it. Raises
        KeyError for an unknown session."""
        with self._db.transaction() as conn:
            if claim is None:
                rows = conn.execute(f"UPDATE sessions SET {col} = {col} + 1 "
                                    f"WHERE id = ? RETURNING {col} - 1",
                                    [session_id]).fetchall()
            else:
                rows = conn.execute(f"UPDATE sessions SET {col} = max({col}, ?) "
                                    "WHERE id = ? RETURNING ?",
                                    [claim + 1, session_id, claim]).fetchall()
        if not rows:
            raise KeyError(f"unknown session {session_id!r}")
        return rows[0][0]

    def heartbeat(self, session_id: str) -> bool:
        return self._db.write("UPDATE sessions SET last_heartbeat = ? WHERE id = ?",
                              (now(), session_id)) > 0

    def finish(self, session_id: str, reason: str | None = None) -> bool:
        """Mark it finished, with the client's reason (success, errored, interrupted)."""
        return self._db.write("UPDATE sessions SET finished_at = ?, finish_reason = ? "
                              "WHERE id = ? AND finished_at IS NULL",
                              (now(), reason, session_id)) > 0

    def get(self, session_id: str) -> Row | None:
        return self._db.one("SELECT * FROM sessions WHERE id = ?", [session_id])

    def list(self, tenant: str, offset: int = 0, limit: int = 20) -> tuple[list[Row], int]:
        return self._db.page("tenant = ?", [tenant], "sessions", offset, limit)

    def children(self, session_id: str) -> tuple[list[str], list[str]]:
        """(training run ids, sampler ids) of a session, for GET /sessions/{id}."""
        runs = self._db.all("SELECT id FROM runs WHERE session_id = ? AND NOT deleted "
                            "ORDER BY rowid", [session_id])
        samplers = self._db.all("SELECT id FROM samplers WHERE session_id = ? ORDER BY rowid",
                                [session_id])
        return [r["id"] for r in runs], [s["id"] for s in samplers]

    def before(self, tenant: str, cursor: tuple[int, str] | None, limit: int) -> list[Row]:
        """A tenant's sessions, newest first, strictly after `cursor` in that order.

        The cursor is (created in whole microseconds, session id): what a REST cursor carries
        as a datetime (microsecond precision), so a page never repeats or skips a row."""
        key = "CAST(round(created * 1000000) AS INTEGER)"
        where, params = "tenant = ?", [tenant]
        if cursor is not None:
            where += f" AND ({key} < ? OR ({key} = ? AND id < ?))"
            params += [cursor[0], cursor[0], cursor[1]]
        return self._db.all(f"SELECT *, {key} AS created_us FROM sessions WHERE {where} "
                            "ORDER BY created_us DESC, id DESC LIMIT ?", [*params, limit])

    def checkpoint_usage(self, session_ids: list[str]) -> dict[str, tuple[int, int]]:
        """session id -> (ready checkpoints, their bytes) of the runs it created."""
        if not session_ids:
            return {}
        marks = ",".join("?" * len(session_ids))
        rows = self._db.all("SELECT r.session_id AS sid, count(*) AS n, "
                            "coalesce(sum(c.size_bytes), 0) AS bytes FROM checkpoints c "
                            "JOIN runs r ON r.id = c.run_id WHERE c.status = 'ready' AND "
                            f"r.session_id IN ({marks}) GROUP BY r.session_id", session_ids)
        return {r["sid"]: (r["n"], r["bytes"]) for r in rows}

    def trace_rows(self, session_id: str) -> dict[str, list[Row]]:
        """What a session's trace is built from: its runs (deleted ones too: they happened),
        samplers, the checkpoints of its runs, and the futures still held of both."""
        runs = self._db.all("SELECT * FROM runs WHERE session_id = ? ORDER BY created",
                            [session_id])
        samplers = self._db.all("SELECT * FROM samplers WHERE session_id = ? ORDER BY created",
                                [session_id])
        checkpoints = self._db.all("SELECT c.tinker_path, c.run_id, c.kind, c.name, c.status, "
                                   "c.size_bytes, c.created FROM checkpoints c JOIN runs r ON "
                                   "r.id = c.run_id WHERE r.session_id = ? ORDER BY c.created",
                                   [session_id])
        owners = [r["id"] for r in runs] + [s["id"] for s in samplers]
        futures: list[Row] = []
        for i in range(0, len(owners), 500):  # SQLite's bound on parameters per statement
            part = owners[i:i + 500]
            futures += self._db.all("SELECT id, kind, model_id, status, created, completed_at "
                                    f"FROM futures WHERE model_id IN ({','.join('?' * len(part))})",
                                    part)
        futures.sort(key=lambda f: f["created"])
        return {"runs": runs, "samplers": samplers, "checkpoints": checkpoints,
                "futures": futures}
