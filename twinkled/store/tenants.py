"""Tenants and their hashed API keys (``store.tenants``), and the running daemon's status
row (``store.status``) that `twinkled ctl status` reads from the same file."""

from __future__ import annotations

import json
import secrets
import time

from twinkled.store.db import Db
from twinkled.store.schema import Row, hash_key, now

KEY_CACHE_S = 2.0


class Tenants:
    """The tenants and api_keys tables."""

    # Per-tenant settings `twinkled ctl tenants set` may change (columns of tenants).
    LIMITS = ("max_queued_requests", "max_queued_tokens", "max_adapters", "max_rank",
              "max_storage_bytes", "max_full_runs")

    def __init__(self, db: Db) -> None:
        self._db = db
        self._known: dict[str, tuple[str, float]] = {}  # key hash -> (tenant, looked up at)

    def ensure(self, name: str, weight: float | None = None) -> Row:
        """Create the tenant if it is new; set its fair-share weight when given."""
        with self._db.transaction() as conn:
            conn.execute("INSERT OR IGNORE INTO tenants (name, weight, created) "
                         "VALUES (?, 1.0, ?)", (name, now()))
            if weight is not None:
                conn.execute("UPDATE tenants SET weight = ? WHERE name = ?", (weight, name))
        return self.get(name)  # type: ignore[return-value]

    def set(self, name: str, weight: float | None = None, **limits: int | None) -> Row:
        """Create or update a tenant: weight and quotas (a limit of 0 clears it, back to
        the config's default; a negative max_storage_bytes means no storage limit)."""
        unknown = set(limits) - set(self.LIMITS)
        if unknown:
            raise ValueError(f"unknown tenant settings {sorted(unknown)}")
        self.ensure(name, weight)
        with self._db.transaction() as conn:
            for key, value in limits.items():
                if value is not None:
                    conn.execute(f"UPDATE tenants SET {key} = ? WHERE name = ?",
                                 (value or None, name))
        return self.get(name)  # type: ignore[return-value]

    def get(self, name: str) -> Row | None:
        return self._db.one("SELECT * FROM tenants WHERE name = ?", [name])

    def list(self) -> list[Row]:
        return self._db.all("SELECT * FROM tenants ORDER BY name")

    def create_key(self, tenant: str) -> str:
        """A new API key for tenant. The key is returned once; only its sha256 is kept."""
        self.ensure(tenant)
        key = "tml-" + secrets.token_urlsafe(32)  # tml- so the tinker client accepts it
        self._db.insert("api_keys", {"key_hash": hash_key(key), "tenant": tenant,
                                     "created": now(), "revoked_at": None})
        return key

    def for_key(self, key: str) -> str | None:
        """The tenant a key authenticates, or None if the key is unknown or revoked.

        Every request asks, so a known key is remembered for KEY_CACHE_S: a key revoked
        here is refused at once, one revoked by another process (`twinkled ctl` on the
        data directory) within that time. Unknown keys are always looked up."""
        h, t = hash_key(key), time.monotonic()
        hit = self._known.get(h)
        if hit is not None and t - hit[1] < KEY_CACHE_S:
            return hit[0]
        row = self._db.one("SELECT tenant FROM api_keys WHERE key_hash = ? "
                           "AND revoked_at IS NULL", [h])
        if row is None:
            self._known.pop(h, None)
            return None
        self._known[h] = (row["tenant"], t)
        return row["tenant"]

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
        self._known.clear()  # refused from the next request on
        with self._db.transaction() as conn:
            n = conn.execute(f"SELECT count(*) FROM api_keys WHERE {where}", args).fetchone()[0]
            if n > 1:
                raise ValueError(f"prefix {key_or_prefix!r} matches {n} keys")
            return conn.execute(f"UPDATE api_keys SET revoked_at = ? WHERE {where} "
                                "AND revoked_at IS NULL", [now(), *args]).rowcount > 0

    def list_keys(self, tenant: str | None = None) -> list[Row]:
        """Key metadata for admins: hash prefix, tenant, created, revoked_at; never keys."""
        where, params = ("WHERE tenant = ?", [tenant]) if tenant else ("", [])
        return self._db.all("SELECT substr(key_hash, 1, 12) AS key_prefix, tenant, created, "
                            f"revoked_at FROM api_keys {where} ORDER BY created", params)


class StatusRow:
    """The daemon_status table's one row: the running daemon's queues and shares, written
    periodically so that `twinkled ctl status` can read them without asking the daemon."""

    def __init__(self, db: Db) -> None:
        self._db = db

    def put(self, body: dict) -> None:
        with self._db.transaction() as conn:
            conn.execute("INSERT OR REPLACE INTO daemon_status (name, body, updated) "
                         "VALUES ('daemon', ?, ?)", (json.dumps(body), now()))

    def get(self) -> Row | None:
        row = self._db.one("SELECT * FROM daemon_status WHERE name = 'daemon'")
        if row is not None:
            row["body"] = json.loads(row["body"])
        return row
