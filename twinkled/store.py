"""Persistence for the daemon: one SQLite file (WAL) through ``sqlite-utils``.

What survives a restart lives here: tenants and hashed API keys, sessions, training runs,
checkpoints, samplers and futures. Calls are short synchronous queries made directly from
the asyncio main process, so nothing here imports torch or blocks for long. The store does
not enforce ownership (the service layer does), but every owned row records its ``tenant``.

Conventions: times are unix seconds (floats; ``to_datetime`` turns them into the UTC
datetimes REST objects need); rows come back as plain dicts with JSON columns decoded and
flag columns as bools; ``get_*`` returns None for a missing row; mutators return whether a
row matched, so the caller can answer 404.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import sqlite_utils

from .futures import UserError
from .schema import (  # noqa: F401 - Conflict and checkpoint_path are the store's API
    CHECKPOINT_TYPES,
    INDEXES,
    MIN_FUTURE_TTL_S,
    SCHEMA,
    Conflict,
    Row,
    checkpoint_path,
    decode_row,
    error_body,
    hash_key,
    now,
    to_datetime,
    to_json,
)
from .store_futures import FutureRows
from .store_sessions import SessionRows

# Tables whose rows carry a tenant's user_metadata (JSON text): it counts toward the
# tenant's storage quota with its checkpoints' files.
METADATA_TABLES = ("sessions", "runs", "checkpoints")


class QuotaExceeded(UserError):
    """The tenant's storage (checkpoint files + stored user_metadata) is at its quota."""


def human_size(n: int | float) -> str:
    """Bytes for a person: 512 B, 1.5 KiB, 50.0 GiB."""
    value, unit = float(n), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{int(n)} B" if unit == "B" else f"{value:.1f} {unit}"


class Store(FutureRows, SessionRows):
    """The daemon's SQLite database. Safe to share between threads (one lock, one conn)."""

    def __init__(self, path: Path | str) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # One connection shared by the event loop and any helper threads; the lock
        # serialises its use, so check_same_thread can be off.
        self.conn = sqlite3.connect(path, check_same_thread=False, timeout=10.0)
        self.db = sqlite_utils.Database(self.conn)
        self._lock = threading.RLock()
        self.db.enable_wal()
        # WAL + NORMAL: no corruption on power loss, at worst the last commits are lost;
        # avoids an fsync per future write.
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self._create_tables()

    def close(self) -> None:
        with self._lock:
            self.conn.close()

    def _create_tables(self) -> None:
        with self._lock, self.db.atomic():
            for name, (columns, pk, defaults) in SCHEMA.items():
                table = self.db.table(name)
                table.create(columns, pk=pk, defaults=defaults, if_not_exists=True)
                for col, kind in columns.items():  # a data dir from an older release
                    if col not in table.columns_dict:
                        table.add_column(col, kind)
            for table, cols, unique in INDEXES:
                self.db.table(table).create_index(cols, unique=unique, if_not_exists=True)

    # -- helpers -------------------------------------------------------------------------

    def _all(self, sql: str, params: Any = ()) -> list[Row]:
        with self._lock:
            cur = self.conn.execute(sql, params)
            cols = [d[0] for d in cur.description]
            return [decode_row(dict(zip(cols, r, strict=True))) for r in cur.fetchall()]

    def _one(self, sql: str, params: Any = ()) -> Row | None:
        rows = self._all(sql, params)
        return rows[0] if rows else None

    def _write(self, sql: str, params: Any = ()) -> int:
        """Run one statement in its own transaction; returns the number of rows changed."""
        with self._lock, self.db.atomic():
            return self.conn.execute(sql, params).rowcount

    @contextlib.contextmanager
    def _immediate(self) -> Iterator[sqlite3.Connection]:
        """One write transaction that holds SQLite's write lock from its first statement
        (BEGIN IMMEDIATE), so a check and the write that depends on it are atomic, also
        against other processes on the same file (`twinkled ctl` beside the daemon)."""
        with self._lock:
            if self.conn.in_transaction:  # nested: the outer transaction holds the lock
                with self.db.atomic():
                    yield self.conn
                return
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                yield self.conn
            except BaseException:
                self.conn.rollback()
                raise
            self.conn.execute("COMMIT")

    def _insert(self, table: str, row: Row) -> None:
        with self._lock:
            try:
                self.db.table(table).insert(row)
            except sqlite3.IntegrityError as e:
                raise Conflict(f"{table}: {e}") from e

    def _page(self, where: str, params: list, table: str, offset: int, limit: int,
              order: str = "created DESC, rowid DESC") -> tuple[list[Row], int]:
        """One page of rows (newest first by default) and the total count."""
        with self._lock:  # count and page from the same state
            total = self._one(f"SELECT count(*) AS n FROM {table} WHERE {where}", params)
            rows = self._all(f"SELECT * FROM {table} WHERE {where} ORDER BY {order} "
                             "LIMIT ? OFFSET ?", [*params, limit, offset])
        return rows, total["n"]  # type: ignore[index]

    # -- tenants and API keys ------------------------------------------------------------

    def ensure_tenant(self, name: str, weight: float | None = None) -> Row:
        """Create the tenant if it is new; set its fair-share weight when given."""
        with self._lock, self.db.atomic():
            self.conn.execute("INSERT OR IGNORE INTO tenants (name, weight, created) "
                              "VALUES (?, 1.0, ?)", (name, now()))
            if weight is not None:
                self.conn.execute("UPDATE tenants SET weight = ? WHERE name = ?",
                                  (weight, name))
        return self.get_tenant(name)  # type: ignore[return-value]

    TENANT_LIMITS = ("max_queued_requests", "max_queued_tokens", "max_adapters", "max_rank",
                     "max_storage_bytes")

    def set_tenant(self, name: str, weight: float | None = None, **limits: int | None) -> Row:
        """Create or update a tenant: weight and quotas (a limit of 0 clears it, back to
        the config's default; a negative max_storage_bytes means no storage limit)."""
        unknown = set(limits) - set(self.TENANT_LIMITS)
        if unknown:
            raise ValueError(f"unknown tenant settings {sorted(unknown)}")
        self.ensure_tenant(name, weight)
        with self._lock, self.db.atomic():
            for key, value in limits.items():
                if value is not None:
                    self.conn.execute(f"UPDATE tenants SET {key} = ? WHERE name = ?",
                                      (value or None, name))
        return self.get_tenant(name)  # type: ignore[return-value]

    def put_status(self, body: dict) -> None:
        with self._lock, self.db.atomic():
            self.conn.execute("INSERT OR REPLACE INTO daemon_status (name, body, updated) "
                              "VALUES ('daemon', ?, ?)", (json.dumps(body), now()))

    def get_status(self) -> Row | None:
        row = self._one("SELECT * FROM daemon_status WHERE name = 'daemon'")
        if row is not None:
            row["body"] = json.loads(row["body"])
        return row

    def get_tenant(self, name: str) -> Row | None:
        return self._one("SELECT * FROM tenants WHERE name = ?", [name])

    def list_tenants(self) -> list[Row]:
        return self._all("SELECT * FROM tenants ORDER BY name")

    def create_key(self, tenant: str) -> str:
        """A new API key for tenant. The key is returned once; only its sha256 is kept."""
        self.ensure_tenant(tenant)
        key = "tml-" + secrets.token_urlsafe(32)  # tml- so the tinker client accepts it
        self._insert("api_keys", {"key_hash": hash_key(key), "tenant": tenant,
                                  "created": now(), "revoked_at": None})
        return key

    def tenant_for_key(self, key: str) -> str | None:
        """The tenant a key authenticates, or None if the key is unknown or revoked."""
        row = self._one("SELECT tenant FROM api_keys WHERE key_hash = ? "
                        "AND revoked_at IS NULL", [hash_key(key)])
        return row["tenant"] if row else None

    def revoke_key(self, key_or_prefix: str) -> bool:
        """Revoke by full key (``tml-...``) or by a hash prefix as shown by list_keys."""
        if key_or_prefix.startswith("tml-"):
            where, args = "key_hash = ?", [hash_key(key_or_prefix)]
        else:
            if len(key_or_prefix) < 6:
                raise ValueError("hash prefix too short (need at least 6 characters)")
            # A literal prefix: compared as text, never a LIKE pattern (% and _ match
            # themselves, so nothing, since hashes are hex).
            prefix = key_or_prefix.lower()
            where, args = "substr(key_hash, 1, ?) = ?", [len(prefix), prefix]
        with self._lock, self.db.atomic():
            n = self.conn.execute(f"SELECT count(*) FROM api_keys WHERE {where}",
                                  args).fetchone()[0]
            if n > 1:
                raise ValueError(f"prefix {key_or_prefix!r} matches {n} keys")
            return self.conn.execute(f"UPDATE api_keys SET revoked_at = ? WHERE {where} "
                                     "AND revoked_at IS NULL", [now(), *args]).rowcount > 0

    def list_keys(self, tenant: str | None = None) -> list[Row]:
        """Key metadata for admins: hash prefix, tenant, created, revoked_at; never keys."""
        where, params = ("WHERE tenant = ?", [tenant]) if tenant else ("", [])
        return self._all("SELECT substr(key_hash, 1, 12) AS key_prefix, tenant, created, "
                         f"revoked_at FROM api_keys {where} ORDER BY created", params)

    # -- sessions (the rest of them: store_sessions.py) ----------------------------------

    def _next_seq(self, col: str, session_id: str, claim: int | None = None) -> int:
        """Hand out the next counter value (atomic, one UPDATE ... RETURNING), or, when the
        client chose the number itself (``claim``), move the counter past it."""
        with self._lock, self.db.atomic():
            if claim is None:
                rows = self.conn.execute(f"UPDATE sessions SET {col} = {col} + 1 "
                                         f"WHERE id = ? RETURNING {col} - 1",
                                         [session_id]).fetchall()
            else:
                rows = self.conn.execute(f"UPDATE sessions SET {col} = max({col}, ?) "
                                         "WHERE id = ? RETURNING ?",
                                         [claim + 1, session_id, claim]).fetchall()
        if not rows:
            raise KeyError(f"unknown session {session_id!r}")
        return rows[0][0]

    def next_model_seq(self, session_id: str) -> int:
        """0, 1, 2 ... per session: the ``<n>`` of ``<session_id>:train:<n>``."""
        return self._next_seq("model_seq", session_id)

    def next_sampler_seq(self, session_id: str) -> int:
        """0, 1, 2 ... per session: the ``<n>`` of ``<session_id>:sample:<n>``."""
        return self._next_seq("sampler_seq", session_id)

    # -- training runs -------------------------------------------------------------------

    def create_run(self, session_id: str, tenant: str, base_model: str, lora_rank: int,
                   lora_config: dict | None = None, user_metadata: dict | None = None,
                   model_seq: int | None = None) -> str:
        """Create ``<session_id>:train:<n>``. The Tinker client sends its own
        ``model_seq_id`` (pass it as model_seq); the native API lets the store pick one.
        Raises KeyError for an unknown session, Conflict if the run exists."""
        seq = self._next_seq("model_seq", session_id, model_seq)
        run_id, t = f"{session_id}:train:{seq}", now()
        self._insert("runs", {"id": run_id, "tenant": tenant, "session_id": session_id,
                              "base_model": base_model, "lora_rank": lora_rank,
                              "lora_config": to_json(lora_config), "created": t,
                              "last_request_time": t, "user_metadata": to_json(user_metadata),
                              "corrupted": 0, "deleted": 0})
        return run_id

    def get_run(self, run_id: str, include_deleted: bool = False) -> Row | None:
        extra = "" if include_deleted else " AND NOT deleted"
        return self._one(f"SELECT * FROM runs WHERE id = ?{extra}", [run_id])

    def touch_run(self, run_id: str) -> bool:
        """Record a request on the run (TrainingRun.last_request_time)."""
        return self._write("UPDATE runs SET last_request_time = ? WHERE id = ?",
                           (now(), run_id)) > 0

    def set_run_corrupted(self, run_id: str, corrupted: bool = True) -> bool:
        return self._write("UPDATE runs SET corrupted = ? WHERE id = ?",
                           (int(corrupted), run_id)) > 0

    def set_run_live(self, run_id: str, live: bool, next_seq: int | None = None,
                     idle_unloaded: bool = False) -> bool:
        """live: loaded now; idle_unloaded: unloaded while idle, back on its next request
        (next_seq then says where its seq_ids continue)."""
        return self._write("UPDATE runs SET live = ?, next_seq = ?, idle_unloaded = ? "
                           "WHERE id = ?", (int(live), next_seq, int(idle_unloaded),
                                            run_id)) > 0

    def idle_runs(self, before: float) -> list[Row]:
        """Loaded runs whose last request is older than `before` (unix seconds)."""
        return self._all("SELECT * FROM runs WHERE live AND NOT deleted AND "
                         "last_request_time < ?", [before])

    def live_runs(self) -> list[Row]:
        """Runs whose adapter was loaded at the last stop (to restore at start-up)."""
        return self._all("SELECT * FROM runs WHERE live AND NOT deleted ORDER BY created")

    def list_runs(self, tenant: str, offset: int = 0,
                  limit: int = 20) -> tuple[list[Row], int]:
        """A tenant's live runs, newest first, and their total count."""
        return self._page("tenant = ? AND NOT deleted", [tenant], "runs", offset, limit)

    def all_runs(self, tenant: str | None = None, limit: int = 1000) -> list[Row]:
        """Live runs of every tenant (or one), newest first: the admin's view."""
        where, params = ("tenant = ? AND NOT deleted", [tenant]) if tenant else ("NOT deleted", [])
        return self._all(f"SELECT * FROM runs WHERE {where} ORDER BY created DESC LIMIT ?",
                         [*params, limit])

    def delete_run(self, run_id: str) -> bool:
        """Soft delete: the id stays taken so a later run never reuses it."""
        return self._write("UPDATE runs SET deleted = 1 WHERE id = ? AND NOT deleted",
                           (run_id,)) > 0

    # -- checkpoints ---------------------------------------------------------------------

    def begin_checkpoint(self, run_id: str, tenant: str, kind: str, name: str, dir: str,
                         user_metadata: dict | None = None,
                         expires_at: float | None = None, *, overwrite: bool = False,
                         quota_bytes: int | None = None) -> str:
        """Record a checkpoint being written (status "writing"); returns its tinker path.

        Check and insert are one transaction (BEGIN IMMEDIATE), so of concurrent saves to
        one name exactly one gets through. Raises ``Conflict`` if that path is being written
        now (whatever ``overwrite`` says) or is ready and ``overwrite`` is False; a corrupt
        row, or a ready one with ``overwrite``, is replaced (its size no longer counts).
        Raises ``QuotaExceeded`` if ``quota_bytes`` is a positive number and the tenant's
        ``storage_used`` (without the row being replaced) is already at or over it; None or
        a number <= 0 means no limit. See ``tenant_storage_quota`` for the number to pass."""
        path = checkpoint_path(run_id, kind, name)
        with self._immediate() as conn:
            old = conn.execute("SELECT status, size_bytes, length(CAST(user_metadata AS "
                               "BLOB)) FROM checkpoints WHERE tinker_path = ?",
                               [path]).fetchone()
            if old is not None and old[0] == "writing":
                raise Conflict(f"checkpoint {path} is being written right now by another "
                               "save; wait for it to finish or use another name")
            if old is not None and old[0] == "ready" and not overwrite:
                raise Conflict(f"checkpoint {path} exists (pass overwrite=True to replace it)")
            if quota_bytes is not None and quota_bytes > 0:
                used = self.storage_used(tenant)
                if old is not None:
                    used -= (old[1] or 0) + (old[2] or 0)
                if used >= quota_bytes:
                    raise QuotaExceeded(
                        f"tenant {tenant!r} uses {human_size(used)} of its "
                        f"{human_size(quota_bytes)} storage quota; delete checkpoints "
                        "(twinkled ctl checkpoints delete / RestClient.delete_checkpoint) "
                        "or ask the operator to raise it")
            conn.execute(
                "INSERT OR REPLACE INTO checkpoints (tinker_path, run_id, tenant, kind, name, "
                "checkpoint_type, dir, size_bytes, sha256, status, error, public, created, "
                "expires_at, user_metadata) VALUES (?, ?, ?, ?, ?, ?, ?, NULL, NULL, "
                "'writing', NULL, 0, ?, ?, ?)",
                [path, run_id, tenant, kind, name, CHECKPOINT_TYPES[kind], str(dir), now(),
                 expires_at, to_json(user_metadata)])
        return path

    def storage_used(self, tenant: str) -> int:
        """Bytes the tenant stores: the recorded sizes of its checkpoints (every row still
        in the table: ready, corrupt or being written; a deleted checkpoint has no row) plus
        the UTF-8 bytes of its user_metadata JSON on sessions, runs and checkpoints."""
        parts = ["SELECT coalesce(sum(size_bytes), 0) FROM checkpoints WHERE tenant = ?"]
        parts += [f"SELECT coalesce(sum(length(CAST(user_metadata AS BLOB))), 0) FROM {t} "
                  "WHERE tenant = ?" for t in METADATA_TABLES]
        sql = "SELECT " + " + ".join(f"({p})" for p in parts)
        with self._lock:
            return int(self.conn.execute(sql, [tenant] * len(parts)).fetchone()[0])

    def tenant_storage_quota(self, tenant: str, default: int | None) -> int | None:
        """The tenant's storage quota in bytes, or None for no limit: its own
        ``max_storage_bytes`` (`twinkled ctl tenants set`; negative: no limit) if set, else
        ``default`` (the caller's: the ``[tenants.NAME]`` table's ``max_storage_bytes``, else
        ``tenant_max_storage_bytes``; ``Config.storage_quota_default`` gives it). A default
        of None or <= 0 means no limit."""
        row = self.get_tenant(tenant)
        value = row.get("max_storage_bytes") if row else None
        if value is None:
            value = default
        return None if value is None or value <= 0 else int(value)

    def finish_checkpoint(self, path: str, size_bytes: int, sha256: str) -> bool:
        """The files are on disk (fsynced and renamed): the checkpoint becomes "ready"."""
        return self._write("UPDATE checkpoints SET status = 'ready', size_bytes = ?, "
                           "sha256 = ?, error = NULL WHERE tinker_path = ?",
                           (size_bytes, sha256, path)) > 0

    def mark_corrupt(self, path: str, reason: str) -> bool:
        """Failed write or checksum mismatch: keep the row (for admins), hide it."""
        return self._write("UPDATE checkpoints SET status = 'corrupt', error = ? "
                           "WHERE tinker_path = ?", (reason, path)) > 0

    def abandon_writing_checkpoints(self, reason: str) -> list[Row]:
        """At start-up: writes cut short by a crash become corrupt; returns those rows so
        the caller can remove their directories."""
        with self._lock, self.db.atomic():
            rows = self._all("SELECT * FROM checkpoints WHERE status = 'writing'")
            self._write("UPDATE checkpoints SET status = 'corrupt', error = ? "
                        "WHERE status = 'writing'", (reason,))
        return rows

    def get_checkpoint(self, path: str) -> Row | None:
        return self._one("SELECT * FROM checkpoints WHERE tinker_path = ?", [path])

    def list_checkpoints(self, run_id: str | None = None, tenant: str | None = None,
                         offset: int = 0, limit: int = 100,
                         status: str | None = "ready") -> tuple[list[Row], int]:
        """Checkpoints of one run or of one tenant (or both), newest first; ready ones
        unless status says otherwise (None: any status, for admins)."""
        where, params = ["1"], []
        for col, val in (("run_id", run_id), ("tenant", tenant), ("status", status)):
            if val is not None:
                where.append(f"{col} = ?")
                params.append(val)
        return self._page(" AND ".join(where), params, "checkpoints", offset, limit)

    def latest_checkpoint(self, run_id: str, kind: str) -> Row | None:
        """Newest ready checkpoint of a kind (TrainingRun.last_[sampler_]checkpoint)."""
        return self._one("SELECT * FROM checkpoints WHERE run_id = ? AND kind = ? AND "
                         "status = 'ready' ORDER BY created DESC, rowid DESC LIMIT 1",
                         [run_id, kind])

    def delete_checkpoint(self, path: str) -> Row | None:
        """Remove the row; returns it (the caller deletes ``dir``) or None if missing."""
        with self._lock, self.db.atomic():
            row = self.get_checkpoint(path)
            if row:
                self._write("DELETE FROM checkpoints WHERE tinker_path = ?", (path,))
        return row

    def set_public(self, path: str, public: bool) -> bool:
        return self._write("UPDATE checkpoints SET public = ? WHERE tinker_path = ?",
                           (int(public), path)) > 0

    def set_expiry(self, path: str, expires_at: float | None) -> bool:
        """Set (unix seconds) or clear (None) a checkpoint's expiry."""
        return self._write("UPDATE checkpoints SET expires_at = ? WHERE tinker_path = ?",
                           (expires_at, path)) > 0

    def expired_checkpoints(self, at: float | None = None) -> list[Row]:
        """Checkpoints (any status) whose expiry has passed, for the garbage collector."""
        return self._all("SELECT * FROM checkpoints WHERE expires_at IS NOT NULL AND "
                         "expires_at <= ? ORDER BY expires_at", [now() if at is None else at])

    # -- samplers ------------------------------------------------------------------------

    def create_sampler(self, session_id: str, tenant: str, base_model: str,
                       model_path: str | None = None, sampler_seq: int | None = None) -> str:
        """Create ``<session_id>:sample:<n>`` (n from the client's sampling_session_seq_id
        when given). Raises KeyError for an unknown session, Conflict if it exists."""
        seq = self._next_seq("sampler_seq", session_id, sampler_seq)
        sampler_id = f"{session_id}:sample:{seq}"
        self._insert("samplers", {"id": sampler_id, "tenant": tenant,
                                  "session_id": session_id, "base_model": base_model,
                                  "model_path": model_path, "created": now()})
        return sampler_id

    def get_sampler(self, sampler_id: str) -> Row | None:
        return self._one("SELECT * FROM samplers WHERE id = ?", [sampler_id])
