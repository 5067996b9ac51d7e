"""Each training run's steps (``store.steps``): what every forward/backward and optimizer
step of a run reported (its metrics: the loss, the stable_reinforce stability figures, the
optimizer's), its tokens and when it finished. The console's curves are drawn from these
rows; futures (which carry the same numbers) are purged after minutes, these are kept.

Beside them, what a client reports of its own run (``store.client_metrics``): numbers the
daemon cannot see, such as an RL loop's reward mean, per step of the client's counting."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from twinkled.protocol.errors import UserError
from twinkled.store.db import Db
from twinkled.store.schema import Row, now

MAX_POINTS = 20_000  # of one run, per request: a curve needs no more


class Steps:
    """The steps table: one row per finished op (run, seq_id); a replay writes it again."""

    def __init__(self, db: Db) -> None:
        self._db = db

    def record(self, run_id: str, seq_id: int, kind: str, metrics: dict[str, float],
               tokens: int = 0) -> None:
        """Called as the op's result is settled (inside the step's store transaction)."""
        numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        self._db.write("INSERT OR REPLACE INTO steps (run_id, seq_id, kind, time, tokens, "
                       "metrics) VALUES (?, ?, ?, ?, ?, ?)",
                       (run_id, seq_id, kind, now(), tokens, json.dumps(numbers)))

    def recorder(self, run_id: str, seq_id: int, kind: str,
                 tokens: int = 0) -> Callable[[Any, str | None], None]:
        """An op's `after` (core/ops.py): records the result's metrics once it succeeded
        (a forward_backward cut into pieces: once, with the merged result)."""
        def after(result: Any, message: str | None) -> None:
            if message is None and isinstance(getattr(result, "metrics", None), dict):
                self.record(run_id, seq_id, kind, result.metrics, tokens)
        return after

    def of_run(self, run_id: str, limit: int = MAX_POINTS) -> list[Row]:
        """A run's steps in order (its first `limit`), metrics decoded."""
        return _of_run(self._db, "seq_id, kind, time, tokens", "steps", "seq_id", run_id,
                       limit)

    def counts(self, run_ids: list[str]) -> dict[str, int]:
        """How many steps each of `run_ids` has recorded (runs with none are left out)."""
        if not run_ids:
            return {}
        out: dict[str, int] = {}
        for i in range(0, len(run_ids), 500):  # SQLite's bound on parameters per statement
            part = run_ids[i:i + 500]
            marks = ",".join("?" * len(part))
            for r in self._db.all(f"SELECT run_id, count(*) AS n FROM steps WHERE run_id IN "
                                  f"({marks}) GROUP BY run_id", part):
                out[r["run_id"]] = r["n"]
        return out


MAX_CLIENT_STEPS = 20_000  # steps of client metrics kept per run (a curve needs no more)


class ClientMetrics:
    """The client_metrics table: one row per (run, step), the step's metrics by name; a
    second report for a step adds its names to the row (a later value of a name wins)."""

    def __init__(self, db: Db) -> None:
        self._db = db

    def report(self, run_id: str, points: list[tuple[int, dict[str, float]]]) -> None:
        """Record `points` (step, metrics) together, or none of them (400: past the cap)."""
        with self._db.immediate() as conn:
            kept = conn.execute("SELECT count(*) FROM client_metrics WHERE run_id = ?",
                                [run_id]).fetchone()[0]
            steps = {s for s, _ in points}
            marks = ",".join("?" * len(steps))
            known = conn.execute(f"SELECT count(*) FROM client_metrics WHERE run_id = ? AND "
                                 f"step IN ({marks})", [run_id, *steps]).fetchone()[0]
            if kept + len(steps) - known > MAX_CLIENT_STEPS:
                raise UserError(f"run {run_id!r} keeps at most {MAX_CLIENT_STEPS} steps of "
                                f"client metrics ({kept} kept)")
            t = now()
            conn.executemany(
                "INSERT INTO client_metrics (run_id, step, time, metrics) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (run_id, step) DO UPDATE SET time = excluded.time, "
                "metrics = json_patch(metrics, excluded.metrics)",
                [(run_id, step, t, json.dumps(m)) for step, m in points])

    def of_run(self, run_id: str, limit: int = MAX_POINTS) -> list[Row]:
        """A run's reported steps in step order (its first `limit`), metrics decoded."""
        return _of_run(self._db, "step, time", "client_metrics", "step", run_id, limit)


def _of_run(db: Db, columns: str, table: str, order: str, run_id: str,
            limit: int) -> list[Row]:
    """A run's first `limit` rows of `table` by `order`, their metrics decoded."""
    rows = db.all(f"SELECT {columns}, metrics FROM {table} WHERE run_id = ? ORDER BY {order} "
                  "LIMIT ?", [run_id, limit])
    for r in rows:
        r["metrics"] = json.loads(r["metrics"] or "{}")
    return rows
