"""Lanes held by full-parameter runs (rank 0: twinkled/engine/full_param.py).

A full run trains its lane's base model itself, so it holds the lane alone: it takes a lane
with no models at all (live, queued or parked in its host memory), and while it lives no
LoRA run is placed there and no base-model sample is sent there (the lane's weights are
the run's). A lane is never taken from under LoRA runs: with none empty the create is
refused, naming the numbers. Torch-free: the daemon's HTTP process owns it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from twinkled.protocol.config import Config
from twinkled.protocol.errors import UserError
from twinkled.protocol.sizing import DTYPE_BYTES, full_run_problem


class _Lane(Protocol):  # what of a Lane (lanes.py) this reads
    index: int
    planner: object
    residency: object
    executor: object


class Exclusive:
    def __init__(self) -> None:
        self._held: dict[int, tuple[str, str]] = {}  # lane index -> (model, tenant)

    def shared(self, lanes: Sequence[_Lane]) -> list:
        """The lanes LoRA runs and base-model samples may use."""
        return [lane for lane in lanes if lane.index not in self._held]

    def lane_of(self, lanes: Sequence[_Lane], model: str):
        """The lane `model` holds, if it holds one."""
        for index, (held, _) in self._held.items():
            if held == model:
                return lanes[index]
        return None

    def count(self, tenant: str | None = None) -> int:
        return sum(tenant is None or t == tenant for _, t in self._held.values())

    def reserve(self, lanes: Sequence[_Lane], model: str, tenant: str):
        """An empty lane for `model`, held until `release`; a clear refusal if none is."""
        if (lane := self.lane_of(lanes, model)) is not None:
            return lane
        lane = self.free_lane(lanes)
        self.hold(lane, model, tenant)
        return lane

    def hold(self, lane: _Lane, model: str, tenant: str) -> None:
        self._held[lane.index] = (model, tenant)

    def free_lane(self, lanes: Sequence[_Lane]):
        """An empty lane (not held yet: `hold` it); a clear refusal if none is."""
        if len(lanes) == 1:
            raise UserError(
                "full-parameter runs (rank 0) need a lane of their own, and this daemon has "
                "one lane, shared by its LoRA runs; ask its operator to start it with "
                "--lanes 2 or more (docs/operator.md, \"Full-parameter runs\")")
        empty = [lane for lane in self.shared(lanes) if _empty(lane)]
        if not empty:
            busy = len(self.shared(lanes))
            raise UserError(
                f"no free lane for a full-parameter run: of {len(lanes)} lanes, "
                f"{len(self._held)} hold full runs and {busy} have LoRA runs; try again when "
                "one is free (lanes are never taken from under LoRA runs)")
        return empty[0]

    def release(self, model: str) -> None:
        self._held = {i: h for i, h in self._held.items() if h[0] != model}


def full_run_lane(lanes, tenants, config: Config, tenant: str):
    """The lane a new full run of `tenant` would take (`Exclusive.hold` it once the run
    exists), after the policy (`full_runs`, `max_full_runs`) and the memory estimate."""
    tenants.check_full_run(tenant, lanes.exclusive.count(tenant))
    lane = lanes.exclusive.free_lane(lanes.up())  # (not a lane whose host is gone)
    model = config.model_config or {}
    problem = model and full_run_problem(model, DTYPE_BYTES.get(config.dtype, 2),
                                         lane.residency.room.budget, len(lane.devices))
    if problem:
        raise UserError(problem)
    return lane


def _empty(lane) -> bool:
    return (lane.planner.model_count() == 0 and lane.residency.count() == 0
            and not lane.residency.tiers.status()["host"])
