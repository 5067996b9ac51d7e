"""Checkpoints (``store.checkpoints``): rows of saved weights, their write states (writing,
ready, corrupt), expiry and public flag, and the per-tenant storage quota they count toward.
The files live where ``checkpoint_store`` says (protocol/blobs.py); a row records where
(``dir``: a directory, or a version's folder in an object store), so a row saved before
the store changed is still found."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from twinkled.protocol.checkpoints import CHECKPOINT_TYPES, checkpoint_path
from twinkled.protocol.errors import Conflict, QuotaExceeded
from twinkled.protocol.sizing import human_size
from twinkled.store.db import Db
from twinkled.store.schema import Row, now, to_json
from twinkled.store.tenants import Tenants

# Tables whose rows carry a tenant's user_metadata (JSON text): it counts toward the
# tenant's storage quota with its checkpoints' files.
METADATA_TABLES = ("sessions", "runs", "checkpoints")
log = logging.getLogger("twinkled.checkpoints")


@dataclass(frozen=True)
class Version:
    """What a save writes: the row its checkpoint gets once the files are written (the
    first arguments of `Checkpoints.begin`, in its order)."""

    run_id: str
    tenant: str
    kind: str
    name: str
    dir: str
    user_metadata: dict | None = None
    expires_at: float | None = None


# A checkpoint's row written whole (a new one, or a new version of one: not public).
_PUT = ("INSERT OR REPLACE INTO checkpoints (tinker_path, run_id, tenant, kind, name, "
        "checkpoint_type, dir, size_bytes, sha256, status, error, public, created, expires_at, "
        "user_metadata) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, NULL, 0, ?, ?, ?)")


def _put(path: str, v: Version, status: str, size_bytes: int | None = None,
         sha256: str | None = None) -> tuple:
    return (path, v.run_id, v.tenant, v.kind, v.name, CHECKPOINT_TYPES[v.kind], v.dir,
            size_bytes, sha256, status, now(), v.expires_at, to_json(v.user_metadata))


class Checkpoints:
    """The checkpoints table, keyed by tinker path."""

    def __init__(self, db: Db, tenants: Tenants) -> None:
        self._db = db
        self._tenants = tenants  # a tenant's own max_storage_bytes overrides the default

    def begin(self, run_id: str, tenant: str, kind: str, name: str, dir: str,
              user_metadata: dict | None = None, expires_at: float | None = None, *,
              overwrite: bool = False, quota_bytes: int | None = None) -> str:
        """Record a checkpoint being written (status "writing"); returns its tinker path.

        Check and insert are one transaction (BEGIN IMMEDIATE), so of concurrent saves to
        one name exactly one gets through. Raises ``Conflict`` if that path is being written
        now (whatever ``overwrite`` says) or is ready and ``overwrite`` is False; a corrupt
        row is replaced (its size no longer counts). A ready one with ``overwrite`` is left
        as it is: it is served until the new version is written (``finish`` with its
        ``Version`` replaces it), and stays if the save fails or never runs.
        Raises ``QuotaExceeded`` if ``quota_bytes`` is a positive number and the tenant's
        ``storage_used`` (without the row being replaced) is already at or over it; None or
        a number <= 0 means no limit. See ``storage_quota`` for the number to pass."""
        path = checkpoint_path(run_id, kind, name)
        with self._db.immediate() as conn:
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
            if old is not None and old[0] == "ready":
                return path
            conn.execute(_PUT, _put(path, Version(run_id, tenant, kind, name, str(dir),
                                                  user_metadata, expires_at), "writing"))
        return path

    def storage_used(self, tenant: str) -> int:
        """Bytes the tenant stores: the recorded sizes of its checkpoints (every row still
        in the table: ready, corrupt or being written; a deleted checkpoint has no row) plus
        the UTF-8 bytes of its user_metadata JSON on sessions, runs and checkpoints, and of
        its sessions' sdk_version and display_name."""
        parts = ["SELECT coalesce(sum(size_bytes), 0) FROM checkpoints WHERE tenant = ?"]
        parts += [f"SELECT coalesce(sum(length(CAST(user_metadata AS BLOB))), 0) FROM {t} "
                  "WHERE tenant = ?" for t in METADATA_TABLES]
        # A session's other stored strings count too (bounded at the door, but many).
        parts += ["SELECT coalesce(sum(coalesce(length(CAST(sdk_version AS BLOB)), 0) + "
                  "coalesce(length(CAST(display_name AS BLOB)), 0)), 0) FROM sessions "
                  "WHERE tenant = ?"]
        sql = "SELECT " + " + ".join(f"({p})" for p in parts) + " AS n"
        return int(self._db.one(sql, [tenant] * len(parts))["n"])  # type: ignore[index]

    def storage_quota(self, tenant: str, default: int | None) -> int | None:
        """The tenant's storage quota in bytes, or None for no limit: its own
        ``max_storage_bytes`` (`twinkled ctl tenants set`; negative: no limit) if set, else
        ``default`` (the caller's: the ``[tenants.NAME]`` table's ``max_storage_bytes``, else
        ``tenant_max_storage_bytes``; ``Config.storage_quota_default`` gives it). A default
        of None or <= 0 means no limit."""
        row = self._tenants.get(tenant)
        value = row.get("max_storage_bytes") if row else None
        if value is None:
            value = default
        return None if value is None or value <= 0 else int(value)

    def usage(self, tenant: str) -> tuple[int, int]:
        """(ready checkpoints, their bytes) of a tenant: what it can list and delete."""
        row = self._db.one("SELECT count(*) AS n, coalesce(sum(size_bytes), 0) AS bytes FROM "
                           "checkpoints WHERE tenant = ? AND status = 'ready'", [tenant])
        return row["n"], row["bytes"]  # type: ignore[index]

    def finish(self, path: str, size_bytes: int, sha256: str,
               version: Version | None = None) -> bool:
        """The files are where readers find them (fsynced and renamed, or uploaded in
        full): the checkpoint becomes "ready".
        With the save's ``version``, its row is written whole (a new version of a ready
        checkpoint replaces the old row only now; one deleted meanwhile comes back, as the
        save that wrote it came after the delete)."""
        if version is not None:
            done = self._db.write(_PUT, _put(path, version, "ready", size_bytes, sha256)) > 0
        else:
            done = self._db.write("UPDATE checkpoints SET status = 'ready', size_bytes = ?, "
                                  "sha256 = ?, error = NULL WHERE tinker_path = ?",
                                  (size_bytes, sha256, path)) > 0
        if done:
            log.info("checkpoint %s saved (%s)", path, human_size(size_bytes),
                     extra={"event": "checkpoint_saved", "checkpoint": path,
                            "size_bytes": size_bytes})
        return done

    def mark_corrupt(self, path: str, reason: str) -> bool:
        """Failed write or checksum mismatch: keep the row (for admins), hide it."""
        return self._db.write("UPDATE checkpoints SET status = 'corrupt', error = ? "
                              "WHERE tinker_path = ?", (reason, path)) > 0

    def abandon(self, path: str, reason: str) -> bool:
        """A save failed (or never ran): a row being written becomes corrupt; a ready one
        (an older version the save would have replaced) stays as it is."""
        return self._db.write("UPDATE checkpoints SET status = 'corrupt', error = ? "
                              "WHERE tinker_path = ? AND status = 'writing'",
                              (reason, path)) > 0

    def abandon_writing(self, reason: str) -> list[Row]:
        """At start-up: writes cut short by a crash become corrupt; returns those rows so
        the caller can remove their directories."""
        with self._db.transaction():
            rows = self._db.all("SELECT * FROM checkpoints WHERE status = 'writing'")
            self._db.write("UPDATE checkpoints SET status = 'corrupt', error = ? "
                           "WHERE status = 'writing'", (reason,))
        return rows

    def get(self, path: str) -> Row | None:
        return self._db.one("SELECT * FROM checkpoints WHERE tinker_path = ?", [path])

    def list(self, run_id: str | None = None, tenant: str | None = None, offset: int = 0,
             limit: int = 100, status: str | None = "ready") -> tuple[list[Row], int]:
        """Checkpoints of one run or of one tenant (or both), newest first; ready ones
        unless status says otherwise (None: any status, for admins)."""
        where, params = ["1"], []
        for col, val in (("run_id", run_id), ("tenant", tenant), ("status", status)):
            if val is not None:
                where.append(f"{col} = ?")
                params.append(val)
        return self._db.page(" AND ".join(where), params, "checkpoints", offset, limit)

    def latest(self, run_id: str, kind: str) -> Row | None:
        """Newest ready checkpoint of a kind (TrainingRun.last_[sampler_]checkpoint)."""
        return self._db.one("SELECT * FROM checkpoints WHERE run_id = ? AND kind = ? AND "
                            "status = 'ready' ORDER BY created DESC, rowid DESC LIMIT 1",
                            [run_id, kind])

    def delete(self, path: str) -> Row | None:
        """Remove the row; returns it (the caller deletes ``dir``) or None if missing."""
        with self._db.transaction():
            row = self.get(path)
            if row:
                self._db.write("DELETE FROM checkpoints WHERE tinker_path = ?", (path,))
        if row:
            log.info("checkpoint %s deleted", path,
                     extra={"event": "checkpoint_deleted", "checkpoint": path})
        return row

    def set_public(self, path: str, public: bool) -> bool:
        return self._db.write("UPDATE checkpoints SET public = ? WHERE tinker_path = ?",
                              (int(public), path)) > 0

    def set_expiry(self, path: str, expires_at: float | None) -> bool:
        """Set (unix seconds) or clear (None) a checkpoint's expiry."""
        return self._db.write("UPDATE checkpoints SET expires_at = ? WHERE tinker_path = ?",
                              (expires_at, path)) > 0

    def expired(self, at: float | None = None) -> list[Row]:
        """Checkpoints (any status) whose expiry has passed, for the garbage collector."""
        return self._db.all("SELECT * FROM checkpoints WHERE expires_at IS NOT NULL AND "
                            "expires_at <= ? ORDER BY expires_at", [now() if at is None else at])
