"""Lanes held by full-parameter runs (rank 0: twinkled/engine/full_param.py).

A full run trains its lane's base model itself, so it holds the lane alone: it takes a lane
with no models at all (live, queued or parked in its host memory), and while it lives no
LoRA run is placed there and no base-model sample is sent there (the lane's weights are
the run's). A lane is never taken from under LoRA runs: with none empty the create is
refused, naming the numbers. A daemon of one lane refuses full runs unless its operator
lets one take that lane (`full_run_only_lane`): then, while it lives, LoRA creates and
loads and base-model samples are refused (400, naming the tenant that holds it), and
the lane is shared again once it ends. Torch-free: the daemon's HTTP process owns it.
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
    def __init__(self, only_lane: bool = False, room: int | None = None) -> None:
        """`only_lane`: a full run may take a one-lane daemon's lane (`full_run_only_lane`);
        `room`: bytes per rank a full run's state has on its lane (`layout.full_run_room`;
        None: no limit known, as on CPUs)."""
        self._held: dict[int, tuple[str, str]] = {}  # lane index -> (model, tenant)
        self.only_lane = only_lane
        self.room = room

    def shared(self, lanes: Sequence[_Lane]) -> list:
        """The lanes LoRA runs and base-model samples may use."""
        return [lane for lane in lanes if lane.index not in self._held]

    def open_to(self, lane: _Lane, model: str | None) -> bool:
        """Whether `model`'s work may go to `lane`: it is not held, or held by `model`."""
        held = self._held.get(lane.index)
        return held is None or held[0] == model

    def lane_of(self, lanes: Sequence[_Lane], model: str):
        """The lane `model` holds, if it holds one."""
        for index, (held, _) in self._held.items():
            if held == model:
                return lanes[index]
        return None

    def count(self, tenant: str | None = None) -> int:
        return sum(tenant is None or t == tenant for _, t in self._held.values())

    def status(self) -> list[dict]:
        """The lanes held, for `ctl status` (admin only: it names runs and tenants)."""
        return [{"lane": i, "run": model, "tenant": tenant}
                for i, (model, tenant) in sorted(self._held.items())]

    def none_shared(self, lanes: Sequence[_Lane], what: str) -> UserError:
        """The refusal of `what` (LoRA runs, base-model samples) when full runs hold every
        lane: who holds them (tenants, never their runs), and that it resumes when one
        ends. A 400: the client must not retry it forever."""
        tenants = ", ".join(sorted({repr(t) for _, t in self._held.values()}))
        if len(lanes) == 1:
            return UserError(f"this daemon's only lane is held by a full-parameter run "
                             f"(rank 0) of tenant {tenants}; {what} can resume when it ends")
        return UserError(f"every one of the {len(lanes)} lanes holds a full-parameter run "
                         f"(tenants {tenants}); {what} can resume when one of those ends")

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
        if len(lanes) == 1 and not self.only_lane:
            raise UserError(
                "full-parameter runs (rank 0) need a lane of their own, and this daemon has "
                "one lane, shared by its LoRA runs; ask its operator to start it with "
                "--lanes 2 or more, or to let a full run take the one lane while no LoRA run "
                "is there (full_run_only_lane = true; docs/operator.md, \"Full-parameter "
                "runs\")")
        empty = [lane for lane in self.shared(lanes) if _empty(lane)]
        if not empty and len(lanes) == 1:
            held = self._held.get(lanes[0].index)
            raise UserError(
                f"this daemon's only lane is held by a full-parameter run of tenant "
                f"{held[1]!r}; try again when it ends" if held else
                "this daemon's only lane has LoRA runs (live, queued or parked); a "
                "full-parameter run can take it when none is left (full_run_only_lane)")
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
                                         lanes.exclusive.room, len(lane.devices))
    if problem:
        raise UserError(problem)
    return lane


def _empty(lane) -> bool:
    return (lane.planner.queues.count() == 0 and lane.residency.count() == 0
            and not lane.residency.tiers.status()["host"])
