"""Lanes in balance: runs move from a lane that holds many more adapters than another to
that one, so the lanes' GPUs share the node's runs evenly whichever were closed where.

A run is placed on a lane when it is created (the one with the fewest models, core/
lanes.py); its tenants then come and go, and one lane may end up with most of the runs while
another idles. Moving a run is the disk tier's round trip (core/tiers.py): the heavy lane
persists its state and closes it, as an idle unload does (weights, moments, and the
journal's ops after the persisted mark), and the light lane brings it in from there, its
seq_ids where they were; its next requests go to the light lane. Only idle runs move
(nothing queued or in flight), least recently used first, a few at a time: the
daemon's housekeeping asks every few seconds.

Long-context runs (core/long_rows.py) come first: while short runs are open too, idle long
runs gather on one lane and idle short runs leave the lanes holding long runs; the lanes
holding none are then evened out among themselves.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # lanes.py imports this module
    from twinkled.core.lanes import Lane, Lanes

log = logging.getLogger("twinkled")

# Lanes whose resident adapters differ by less than this are in balance (moving one run
# from one to the other would only swap which one has more).
SPREAD = 2
MOVES_PER_ROUND = 4  # at most this many runs move per call: each costs a persist and a load


def load(lane: Lane) -> int:
    """A lane's load: the adapters in its GPU bank."""
    return lane.residency.count()


async def balance(lanes: Lanes) -> int:
    """Keep long and short runs apart (long_rows.py), then move idle runs from the most
    loaded lane to the least until they differ by less than SPREAD (or MOVES_PER_ROUND
    moved, or none can move now); how many moved."""
    # (not a gone host's lane, nor one a full run holds: no LoRA run goes there)
    moved = await lanes.long.keep_apart(lanes.exclusive.shared(lanes.up()), lanes.move,
                                        MOVES_PER_ROUND)
    while moved < MOVES_PER_ROUND and \
            len(up := lanes.long.even_among(lanes.exclusive.shared(lanes.up()))) > 1:
        light = min(up, key=lambda lane: (load(lane), lane.index))
        heavy = max(up, key=lambda lane: (load(lane), -lane.index))
        if load(heavy) - load(light) < SPREAD:
            break
        for model in heavy.residency.movable():
            if await lanes.move(model, light):
                moved += 1
                break
        else:
            break  # every run of the heavy lane has work now: next time
    return moved
