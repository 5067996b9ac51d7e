"""Long-context runs on lanes of their own (issue 38).

One training pass cannot be preempted: a row of 65,536 tokens holds its worker group for
its whole step (12.4 s on 2 x H200, Qwen3-8B, --cp 2), and a small tenant co-batched with it
or queued behind it waits that long for a step that takes 0.27 s alone. A one-lane daemon
can do nothing about that; a daemon of several lanes (core/lanes.py) can keep the long runs
on lanes of their own so the short tenants on the others never wait for a long row.

A run becomes *long* the first time it sends a training row (forward_backward or forward)
longer than `long_row_tokens` (the daemon's service tells this object at submit, where the
rows are measured). Then, with two or more lanes up:

- a new run (short until it sends a long row) is placed on a lane holding no long run, and
  a long run brought back (an idle unload, a gone host) on the lane holding the most;
- while short runs are open, the balancer (core/balance.py) gathers idle long runs on one
  "long lane" (the one holding the most) and moves idle short runs off any lane with a long
  run, through the same move an idle run makes to even out the lanes (its state through the
  disk, its seq_ids where they were); the other lanes are evened out among themselves;
- with no short run open, nothing is kept apart: long runs spread as any runs do.

Nothing here refuses or holds back work: where no lane fits the rule, a run goes where it
would have gone anyway, and a run moves only when idle. With one lane nothing changes.
A run stays long while the daemon runs (its next rows are most likely long too); after a
restart it becomes long again at its first long row.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

log = logging.getLogger("twinkled")


class _Residency(Protocol):  # what of a lane's Residency this reads
    def is_open(self, model: str) -> bool: ...
    def movable(self) -> list[str]: ...
    def count(self) -> int: ...


class _Planner(Protocol):
    def model_count(self, tenant: str | None = None) -> int: ...


class _Lane(Protocol):  # what of a Lane (lanes.py) this reads
    index: int
    planner: _Planner
    residency: _Residency


Move = Callable[[str, _Lane], Awaitable[bool]]  # Lanes.move: an idle run to another lane


class LongRuns:
    """Which runs are long, and where runs go so that short runs keep off their lanes."""

    def __init__(self, threshold: int = 0) -> None:
        """`threshold`: the row length (tokens) above which a run is long (0: never)."""
        self.threshold = threshold
        self._long: dict[str, str] = {}  # model -> its tenant (for `ctl status`)

    def saw(self, model: str, tenant: str, longest: int) -> bool:
        """A training request of `model` whose longest row has `longest` tokens: whether it
        makes the run long now (the first time only)."""
        if self.threshold <= 0 or longest <= self.threshold or model in self._long:
            return False
        self._long[model] = tenant
        log.info("run %s is long-context (a row of %d tokens > long_row_tokens %d): it "
                 "goes to a lane of long runs", model, longest, self.threshold)
        return True

    def is_long(self, model: str) -> bool:
        return model in self._long

    def on(self, lane: _Lane) -> list[str]:
        """The long runs open on `lane`."""
        return [m for m in self._long if lane.residency.is_open(m)]

    def shorts_on(self, lane: _Lane) -> int:
        """How many short runs are open on `lane`."""
        return lane.planner.queues.count() - len(self.on(lane))

    # -- placement ----------------------------------------------------------------------

    def prefer(self, lanes: Sequence[_Lane], model: str | None) -> list:
        """Of `lanes` (those with room for a run), where `model` should go: a long run to
        the lanes holding the most long runs, any other (a new run is short) to those
        holding none. All of `lanes` when none is such: nothing is refused for this."""
        if not self._long or len(lanes) < 2:
            return list(lanes)
        held = {lane.index: len(self.on(lane)) for lane in lanes}
        if model is not None and self.is_long(model):
            most = max(held.values())
            return [lane for lane in lanes if held[lane.index] == most] if most else list(lanes)
        return [lane for lane in lanes if not held[lane.index]] or list(lanes)

    def even_among(self, lanes: Sequence[_Lane]) -> list:
        """The lanes to even out by count (core/balance.py): while long and short runs are
        both open, those holding no long run (the long ones are kept apart instead)."""
        if not self._apart(lanes):
            return list(lanes)
        return [lane for lane in lanes if not self.on(lane)]

    def _apart(self, lanes: Sequence[_Lane]) -> bool:
        """Whether long and short runs are to be kept apart on `lanes` now."""
        return (len(lanes) > 1 and any(self.on(lane) for lane in lanes)
                and any(self.shorts_on(lane) for lane in lanes))

    async def keep_apart(self, lanes: Sequence[_Lane], move: Move, budget: int) -> int:
        """Move up to `budget` idle runs: long runs onto the long lane, then short runs off
        every lane holding a long run; how many moved."""
        if budget <= 0 or not self._apart(lanes):
            return 0
        # The long lane: the most long runs, then the fewest short ones (less to move off).
        target = max((lane for lane in lanes if self.on(lane)),
                     key=lambda lane: (len(self.on(lane)), -self.shorts_on(lane), -lane.index))
        moved = 0
        for lane in lanes:
            if lane is target:
                continue
            for model in lane.residency.movable():
                if moved < budget and self.is_long(model) and await move(model, target):
                    moved += 1
        for lane in lanes:
            if not self.on(lane):
                continue
            for model in lane.residency.movable():
                free = [other for other in lanes if not self.on(other)]
                if moved >= budget or not free:
                    return moved
                to = min(free, key=lambda other: (other.residency.count(), other.index))
                if not self.is_long(model) and await move(model, to):
                    moved += 1
        return moved

    def status(self, lanes: Sequence[_Lane]) -> list[dict]:
        """The long runs open and their lanes, for `ctl status` (admin only: it names runs
        and tenants)."""
        return [{"lane": lane.index, "run": model, "tenant": self._long[model]}
                for lane in lanes for model in self.on(lane)]
