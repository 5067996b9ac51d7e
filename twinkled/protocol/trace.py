"""Per-step timing trace for profiling the host path (off unless TWINKLED_TRACE is set).

`TWINKLED_TRACE=/path/trace.jsonl twinkled serve ...` appends one JSON line per event: the
loop's view of a step (plan, execute, complete, the wait for clients before it; for a
training step what the planner expected: `predicted` seconds, `tokens`, `micro_tokens`, 0
where the step was not cut for joins) and the
worker group's (when each rank got the frame, started, finished, and when its reply
arrived), all in wall-clock seconds so that the worker processes' stamps line up with
the daemon's. Each event names its lane (twinkled/core/lanes.py: each lane's loop runs in its
own task, which sets it). `bench/trace_report.py` turns a trace into a table. Off, it costs
one attribute check per step.
"""

from __future__ import annotations

import contextvars
import json
import os
from typing import Any

_path = os.environ.get("TWINKLED_TRACE") or None
_lane: contextvars.ContextVar[int] = contextvars.ContextVar("lane", default=0)


def in_lane(index: int) -> None:
    """The events the current task records from now on are lane `index`'s."""
    _lane.set(index)


def enabled() -> bool:
    return _path is not None


def record(event: str, **fields: Any) -> None:
    """Append one event; a no-op when tracing is off."""
    if _path is None:
        return
    with open(_path, "a") as f:  # tens of lines a second at most: no handle kept open
        f.write(json.dumps({"event": event, "lane": _lane.get(), **fields}) + "\n")
