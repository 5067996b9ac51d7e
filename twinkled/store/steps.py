"""Each training run's steps (``store.steps``): what every forward/backward and optimizer
step of a run reported (its metrics: the loss, the stable_reinforce stability figures, the
optimizer's), its tokens and when it finished. The console's curves are drawn from these
rows; futures (which carry the same numbers) are purged after minutes, these are kept."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

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
        rows = self._db.all("SELECT seq_id, kind, time, tokens, metrics FROM steps WHERE "
                            "run_id = ? ORDER BY seq_id LIMIT ?", [run_id, limit])
        for r in rows:
            r["metrics"] = json.loads(r["metrics"] or "{}")
        return rows

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
