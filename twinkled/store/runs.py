"""Training runs (``store.runs``) and samplers (``store.samplers``): the models a session
creates, numbered by the session's counters (``<session_id>:train:<n>``, ``:sample:<n>``)."""

from __future__ import annotations

import logging
import math

from twinkled.store.db import Db
from twinkled.store.schema import Row, now, to_json
from twinkled.store.sessions import Sessions

TOUCH_EVERY_S = 1.0
log = logging.getLogger("twinkled.runs")


class Runs:
    """The runs table. Rows are never removed: a deleted run keeps its id taken."""

    def __init__(self, db: Db, sessions: Sessions) -> None:
        self._db = db
        self._sessions = sessions
        self._touched: dict[str, float] = {}  # run id -> the last_request_time written

    def create(self, session_id: str, tenant: str, base_model: str, lora_rank: int,
               lora_config: dict | None = None, user_metadata: dict | None = None,
               model_seq: int | None = None) -> str:
        """Create ``<session_id>:train:<n>``. The Tinker client sends its own
        ``model_seq_id`` (pass it as model_seq); the native API lets the store pick one.
        Raises KeyError for an unknown session, Conflict if the run exists."""
        seq = self._sessions.next_model_seq(session_id, model_seq)
        run_id, t = self.id_of(session_id, seq), now()
        self._db.insert("runs", {"id": run_id, "tenant": tenant, "session_id": session_id,
                                 "base_model": base_model, "lora_rank": lora_rank,
                                 "lora_config": to_json(lora_config), "created": t,
                                 "last_request_time": t,
                                 "user_metadata": to_json(user_metadata),
                                 "corrupted": 0, "deleted": 0})
        log.info("run %s created by tenant %s (%s, rank %d)", run_id, tenant, base_model,
                 lora_rank, extra={"event": "run_created", "run_id": run_id,
                                   "tenant": tenant, "lora_rank": lora_rank})
        return run_id

    @staticmethod
    def id_of(session_id: str, model_seq: int) -> str:
        """The id of a session's run number `model_seq`."""
        return f"{session_id}:train:{model_seq}"

    def get(self, run_id: str, include_deleted: bool = False) -> Row | None:
        extra = "" if include_deleted else " AND NOT deleted"
        return self._db.one(f"SELECT * FROM runs WHERE id = ?{extra}", [run_id])

    def touch(self, run_id: str) -> bool:
        """Record a request on the run (TrainingRun.last_request_time), to the second: a
        run's requests within a second of the last one written are not written again
        (a busy tenant sends several a second; idle unloading counts minutes)."""
        t = now()
        if t - self._touched.get(run_id, -math.inf) < TOUCH_EVERY_S:
            return True
        self._touched[run_id] = t
        return self._db.write("UPDATE runs SET last_request_time = ? WHERE id = ?",
                              (t, run_id)) > 0

    def set_corrupted(self, run_id: str, corrupted: bool = True) -> bool:
        return self._db.write("UPDATE runs SET corrupted = ? WHERE id = ?",
                              (int(corrupted), run_id)) > 0

    def set_live(self, run_id: str, live: bool, next_seq: int | None = None,
                 idle_unloaded: bool = False) -> bool:
        """live: loaded now; idle_unloaded: unloaded while idle, back on its next request
        (next_seq then says where its seq_ids continue)."""
        return self._db.write("UPDATE runs SET live = ?, next_seq = ?, idle_unloaded = ? "
                              "WHERE id = ?", (int(live), next_seq, int(idle_unloaded),
                                               run_id)) > 0

    def idle(self, before: float) -> list[Row]:
        """Loaded runs whose last request is older than `before` (unix seconds)."""
        return self._db.all("SELECT * FROM runs WHERE live AND NOT deleted AND "
                            "last_request_time < ?", [before])

    def parked(self, tenant: str, since: float) -> int:
        """How many of `tenant`'s runs are parked out of the workers (host memory or disk,
        core/tiers.py) with a request since `since` (unix seconds): those idle longer are
        unloaded as idle, not parked for room."""
        row = self._db.one("SELECT COUNT(*) AS n FROM runs WHERE tenant = ? AND NOT live AND "
                           "idle_unloaded AND NOT deleted AND last_request_time >= ?",
                           [tenant, since])
        return row["n"] if row else 0

    def live(self) -> list[Row]:
        """Runs whose adapter was loaded at the last stop (to restore at start-up)."""
        return self._db.all("SELECT * FROM runs WHERE live AND NOT deleted ORDER BY created")

    def list(self, tenant: str, offset: int = 0, limit: int = 20) -> tuple[list[Row], int]:
        """A tenant's live runs, newest first, and their total count."""
        return self._db.page("tenant = ? AND NOT deleted", [tenant], "runs", offset, limit)

    def all(self, tenant: str | None = None, limit: int = 1000) -> list[Row]:
        """Live runs of every tenant (or one), newest first: the admin's view."""
        where, params = ("tenant = ? AND NOT deleted", [tenant]) if tenant else ("NOT deleted", [])
        return self._db.all(f"SELECT * FROM runs WHERE {where} ORDER BY created DESC LIMIT ?",
                            [*params, limit])

    def delete(self, run_id: str) -> bool:
        """Soft delete: the id stays taken so a later run never reuses it."""
        deleted = self._db.write("UPDATE runs SET deleted = 1 WHERE id = ? AND NOT deleted",
                                 (run_id,)) > 0
        if deleted:
            log.info("run %s deleted", run_id, extra={"event": "run_deleted", "run_id": run_id})
        return deleted


class Samplers:
    """The samplers table: a sampling client's model (base, or a saved checkpoint)."""

    def __init__(self, db: Db, sessions: Sessions) -> None:
        self._db = db
        self._sessions = sessions

    def create(self, session_id: str, tenant: str, base_model: str,
               model_path: str | None = None, sampler_seq: int | None = None) -> str:
        """Create ``<session_id>:sample:<n>`` (n from the client's sampling_session_seq_id
        when given). Raises KeyError for an unknown session, Conflict if it exists."""
        seq = self._sessions.next_sampler_seq(session_id, sampler_seq)
        sampler_id = self.id_of(session_id, seq)
        self._db.insert("samplers", {"id": sampler_id, "tenant": tenant,
                                     "session_id": session_id, "base_model": base_model,
                                     "model_path": model_path, "created": now()})
        return sampler_id

    @staticmethod
    def id_of(session_id: str, sampler_seq: int) -> str:
        """The id of a session's sampler number `sampler_seq`."""
        return f"{session_id}:sample:{sampler_seq}"

    def get(self, sampler_id: str) -> Row | None:
        return self._db.one("SELECT * FROM samplers WHERE id = ?", [sampler_id])
