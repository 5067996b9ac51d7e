"""Where the ranks run, as the core sees it: `WorkerGroup` (workers/supervisor.py: one
process per device, ZeroMQ frames) in the daemon, or `InProcessGroup` (workers/inprocess.py:
the same StepRunner on an engine in this process, in a thread) for tests and single-process
use. The frames are the same either way."""

from __future__ import annotations

import asyncio
from typing import Protocol

from twinkled.protocol.frames import ReplyF, StepF
from twinkled.workers.gaps import GapWindow


class Transport(Protocol):
    """Where the ranks run: every rank gets the same step, their replies come back in rank
    order; WorkerLost when a rank dies (then `restart`)."""

    devices: list[str]
    model_info: dict
    restarts: int
    gaps: GapWindow  # sampler vs trainer logprob gaps the replies reported (workers/gaps.py)

    @property
    def exits(self) -> list[asyncio.Future]: ...
    def dead(self) -> str: ...
    async def start(self) -> None: ...
    async def run(self, step: StepF) -> list[ReplyF]: ...
    # A small step sent into the training step in flight, run between its micro-batches
    # and answered at once (EngineCore._joins); only while can_join() (one rank).
    def can_join(self) -> bool: ...
    def send_join(self, step: StepF) -> asyncio.Future: ...  # sent now; result: [its reply]
    # Work arrived: a sampling slice in flight that may run long (StepF.slice_max_s) ends
    # once its `slice_s` passed. Nothing when no such slice runs.
    def nudge(self) -> None: ...
    async def restart(self) -> None: ...
    async def stop(self) -> None: ...
    def status(self) -> list[dict]: ...
