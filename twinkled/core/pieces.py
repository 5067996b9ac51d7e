"""The results of a forward/backward op that the planner cut between datums (its pieces run
in successive steps), merged into the one result its client gets."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from twinkled.core.ops import Op, Outcome


class Pieces:
    """The results of a forward/backward the planner cut between datums, until its last
    piece has run: then one result, as if it had run whole."""

    def __init__(self) -> None:
        self._done: dict[str, list] = {}  # future id -> results of its pieces so far

    def add(self, op: Op, outcome: Outcome) -> Outcome | None:
        """The whole op's outcome once it is known (a piece failed, or the last one ran);
        None while more pieces are to come."""
        result, message, _ = outcome
        if message is not None:
            self._done.pop(op.future.id, None)
            return outcome
        parts = self._done.setdefault(op.future.id, [])
        parts.append(result)
        if not op.piece[1]:
            return None
        del self._done[op.future.id]
        merged = type(result)(outputs=[o for r in parts for o in r.outputs], metrics={})
        for r in parts:
            for k, v in r.metrics.items():
                merged.metrics[k] = merged.metrics.get(k, 0.0) + v if k.endswith(":sum") else v
        return merged, None, None
