"""The daemon's SQLite tables and the conventions of their rows (see store.py).

Times are unix seconds; JSON columns are text, decoded on the way out; flags are 0/1
integers, returned as bools.
"""

from __future__ import annotations

import hashlib
import json
import time
from datetime import UTC, datetime
from typing import Any

Row = dict[str, Any]
MIN_FUTURE_TTL_S = 300.0  # a completed future stays readable at least this long
JSON_COLS = ("user_metadata", "lora_config")
BOOL_COLS = ("corrupted", "deleted", "public", "live", "idle_unloaded")
# table -> (columns, primary key, defaults). Flags are 0/1 ints, JSON columns are text.
SCHEMA: dict[str, tuple[dict[str, type], str | tuple[str, ...], dict[str, Any]]] = {
    # Quotas are NULL for "unlimited" (or the config file's default); max_storage_bytes
    # (checkpoints + user_metadata) is NULL for the config's default, negative for unlimited.
    "tenants": ({"name": str, "weight": float, "created": float, "max_queued_requests": int,
                 "max_queued_tokens": int, "max_adapters": int, "max_rank": int,
                 "max_storage_bytes": int, "max_full_runs": int}, "name", {"weight": 1.0}),
    # The running daemon's status (queues, shares), for `twinkled ctl status`.
    "daemon_status": ({"name": str, "body": str, "updated": float}, "name", {}),
    "api_keys": ({"key_hash": str, "tenant": str, "created": float, "revoked_at": float},
                 "key_hash", {}),
    # model_seq / sampler_seq: the next per-session counter values to hand out;
    # finish_reason: what the client said when it finished it (success, errored, interrupted)
    "sessions": ({"id": str, "tenant": str, "created": float, "last_heartbeat": float,
                  "finished_at": float, "user_metadata": str, "sdk_version": str,
                  "model_seq": int, "sampler_seq": int, "display_name": str,
                  "finish_reason": str}, "id",
                 {"model_seq": 0, "sampler_seq": 0}),
    "runs": ({"id": str, "tenant": str, "session_id": str, "base_model": str, "lora_rank": int,
              "lora_config": str, "created": float, "last_request_time": float,
              "user_metadata": str, "corrupted": int, "deleted": int,
              # live: its adapter is loaded (restored at start-up from data_dir/live/);
              # next_seq: set by a hot restart, so the run's seq_ids continue exactly.
              "live": int, "next_seq": int, "idle_unloaded": int}, "id",
             {"corrupted": 0, "deleted": 0, "live": 0, "idle_unloaded": 0}),
    "checkpoints": ({"tinker_path": str, "run_id": str, "tenant": str, "kind": str, "name": str,
                     "checkpoint_type": str, "dir": str, "size_bytes": int, "sha256": str,
                     "status": str, "error": str, "public": int, "created": float,
                     "expires_at": float, "user_metadata": str}, "tinker_path", {"public": 0}),
    "samplers": ({"id": str, "tenant": str, "session_id": str, "base_model": str,
                  "model_path": str, "created": float}, "id", {}),
    # What each finished training op of a run reported (store/steps.py: the console's curves)
    "steps": ({"run_id": str, "seq_id": int, "kind": str, "time": float, "tokens": int,
               "metrics": str}, ("run_id", "seq_id"), {"tokens": 0}),
    # What a client reported of its own run, per step (a reward mean, ...): steps.py
    "client_metrics": ({"run_id": str, "step": int, "time": float, "metrics": str},
                       ("run_id", "step"), {}),
    "futures": ({"id": str, "tenant": str, "kind": str, "model_id": str, "seq_id": int,
                 "status": str, "result": bytes, "content_type": str, "created": float,
                 "completed_at": float}, "id", {}),
}
INDEXES = [
    ("sessions", ["tenant", "created"], False),
    ("runs", ["tenant", "created"], False),
    ("runs", ["session_id"], False),
    ("checkpoints", ["run_id", "created"], False),
    ("checkpoints", ["tenant", "created"], False),
    ("samplers", ["session_id"], False),
    ("futures", ["model_id", "seq_id"], True),  # one future per (model, seq): retries
    ("futures", ["status", "completed_at"], False),
]


def now() -> float:
    return time.time()


def to_datetime(ts: float | None) -> datetime | None:
    """Stored unix seconds -> aware UTC datetime (None stays None), for REST objects."""
    return None if ts is None else datetime.fromtimestamp(ts, UTC)


def hash_key(key: str) -> str:
    """Keys are 256-bit random tokens, so an unsalted sha256 is enough to store them."""
    return hashlib.sha256(key.encode()).hexdigest()


def decode_row(row: Row) -> Row:
    for c in JSON_COLS:
        if isinstance(row.get(c), str):
            row[c] = json.loads(row[c])
    for c in BOOL_COLS:
        if c in row:
            row[c] = bool(row[c])
    return row


def to_json(value: Any) -> str | None:
    return None if value is None else json.dumps(value)


def error_body(message: str, category: str) -> bytes:
    """The failed-future body the Tinker client raises RequestFailedError on."""
    return json.dumps({"error": message, "category": category}).encode()
