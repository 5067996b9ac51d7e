"""The moves of a lane's training adapters between the tiers (core/tiers.py): to host
memory, on to disk, back into the GPU bank, each a frame the workers run and charged to the
fair share of the tenant that needs it. Residency (residency.py) decides what moves and
keeps what is live; this runs the moves and counts them in the tiers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from scheduler import Planner
from twinkled.core.executor import Executor, Moved
from twinkled.core.tiers import Tiers
from twinkled.protocol.frames import IdleUnloadF, OpF, ParkF, UnparkF
from twinkled.protocol.types import LoraConfig

log = logging.getLogger("twinkled")
# Whom a move is charged to: a tenant, or the tenants whose runs one batch of parks made
# room for (each pays an equal share), or no one.
Needer = str | tuple[str, ...] | None


class TierMoves:
    def __init__(self, executor: Executor, planner: Planner, tiers: Tiers,
                 moving: Callable[[str], bool]):
        """`moving(model)`: a move of it is under way (Residency's lock of it is held)."""
        self._executor = executor
        self._planner = planner
        self._tiers = tiers
        self._moving = moving

    async def host_room(self, config: LoraConfig, incoming: str | None,
                        needer: Needer = None) -> bool:
        """Whether an adapter of `config` can be parked in host memory, once the least
        recently parked there have gone on to disk (`incoming` counted as gone: it is
        brought in next, so an exchange of the two never spills it)."""
        if not self._tiers.host.fits_ever(config):
            return False
        while not self._tiers.host.fits(config, leaving=incoming):
            if not await self.spill_coldest(incoming, needer):
                return False
        return True

    async def spill_coldest(self, incoming: str | None, needer: Needer = None) -> bool:
        """The least recently used adapter in host memory on to disk; False if none can go.
        Never `incoming` (its lock held, its unpark perhaps in flight: spilled now, it
        would leave the bank the moment it came back)."""
        coldest = [m for m in self._tiers.on_host_models()
                   if m != incoming and not self._moving(m)]
        return bool(coldest) and await self.host_to_disk(coldest[0], needer)

    async def host_to_disk(self, model: str, needer: Needer = None) -> bool:
        """A host-parked adapter on to disk (the caller holds Residency's `_admitting`)."""
        error = (await self.move(IdleUnloadF(model), needer)).error
        if error is not None:
            log.error("moving parked adapter %s to disk failed: %s", model, error)
            return False
        config = self._tiers.left_host(model)
        if config is not None:
            self._tiers.moved(model, "to_disk", config)
        return True

    async def bring_in(self, model: str, config: LoraConfig, needer: str) -> str | None:
        """A parked adapter into the GPU bank (its room is held): from host memory as it
        was (inside the training step in flight where it can: a prefetch), else from disk
        (persisted state, then the journal). Why not, if it failed. A move between steps
        while the lane had work is a prefetch miss (that work waited for it)."""
        if self._tiers.on_host(model):
            idle = self._planner.idle()
            moved = await self.move(UnparkF(model), needer)
            self._tiers.left_host(model)
            if moved.error is None:
                self._tiers.moved(model, "from_host", config)
                self._tiers.prefetched(moved.overlapped or idle)
                return None
            log.warning("adapter %s was not in host memory (%s); restoring it from disk",
                        model, moved.error)
        idle = self._planner.idle()
        born = self._tiers.born(model)  # (a new run's first coming: made, not moved)
        moved = await self._executor.restore_one(model, config)
        self._planner.charge(needer, moved.seconds)
        if moved.error is None and not born:
            self._tiers.moved(model, "from_disk", config)
            self._tiers.prefetched(idle)
        return moved.error

    async def move(self, frame: OpF, needer: Needer = None) -> Moved:
        """One move on the workers (`moves`)."""
        return (await self.moves([frame], needer))[0]

    async def moves(self, frames: list[OpF], needer: Needer = None) -> list[Moved]:
        """Moves on the workers in one frame (ParkF and UnparkF inside the training step in
        flight where they can), their time charged to `needer`'s fair share. A worker lost
        meanwhile is a failure of each move (the group restarts; the caller keeps what it
        had)."""
        try:
            moved = await self._executor.moves(
                frames, overlap=all(isinstance(f, ParkF | UnparkF) for f in frames))
        except Exception as e:
            return [Moved((None, f"{type(e).__name__}: {e}", "server"))] * len(frames)
        self._charge(needer, sum(m.seconds for m in moved))
        return moved

    def _charge(self, needer: Needer, seconds: float) -> None:
        needers = (needer,) if isinstance(needer, str) else needer or ()
        for tenant in needers:
            self._planner.charge(tenant, seconds / len(needers))
