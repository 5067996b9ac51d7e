"""A lane on another host: a worker group whose every rank runs on one joined host.

A host that joins with `--lanes N` (host.py) brings N lanes; each is a `RemoteLaneGroup`,
driven by its own executor and core like the head's lanes (core/remote_lanes.py). It is a
WorkerGroup with no local ranks: its ranks are the devices of lane `index` of the host
called `host`, assigned through the daemon's host registry, and they reach the head's step
socket and rendezvous like the ranks of a group that spans hosts.

When its host is gone (lost, or not joined again yet) the group is *down*: it starts no
ranks, every step on it fails at once (its runs went to other lanes: remote_lanes.py), and
its one "exit" is the host's return, upon which the executor's watch restarts it there.
So a lane's index, executor and journal outlive its host; a host that comes back takes
new work on the same lanes.
"""

from __future__ import annotations

import asyncio
import logging

from twinkled.protocol.frames import ReplyF, StepF

from .gaps import GapWindow
from .hosts import HostRegistry, JoinSettings, RemoteHost
from .supervisor import WorkerGroup, WorkerLost

log = logging.getLogger("twinkled")


class RemoteLaneGroup(WorkerGroup):
    def __init__(self, hosts: HostRegistry, join: JoinSettings, host: str, index: int,
                 options: dict, step_timeout: float = 900.0):
        super().__init__([], options, step_timeout=step_timeout, join=join, hosts=hosts)
        self.host, self.index = host, index
        self.down = "starting"  # why the lane takes no work now ("" when it does)
        self._back: asyncio.Future | None = None  # resolves when its host joins again

    @property
    def lane_devices(self) -> list[str]:
        """Its ranks' devices (as of its last start)."""
        return [w.device for w in self.workers]

    @property
    def exits(self) -> list[asyncio.Future]:
        if self.down:
            return [self._waiting()]
        return super().exits

    def dead(self) -> str:
        """Why the group must (re)start: a rank lost, or, while down, its host back."""
        if self.down:
            back = self._waiting()
            return back.result() if back.done() else ""
        return super().dead()

    def lose(self, why: str) -> None:
        """Its host is gone: down now (no work is placed here); the step in flight fails
        as its host's ranks are reported lost."""
        self.down = why

    def _waiting(self) -> asyncio.Future:
        if self._back is None:
            self._back = asyncio.get_running_loop().create_future()
        return self._back

    def _on_join(self, host: RemoteHost) -> None:
        if host.name == self.host and self.index < len(host.lanes) and self.down:
            back = self._waiting()
            if not back.done():
                back.set_result(f"host {host.name} joined again: lane {self.index} restarts")

    async def start(self) -> None:
        """Its ranks on its host, the model loaded; down (not an error) when the host is
        not here or its ranks fail to start: it comes up when the host joins again."""
        if self._back is not None and self._back.done():  # (one still awaited stays)
            self._back = None
        host = self.hosts.lane_host(self.host)
        if host is None or self.index >= len(host.lanes):
            self.down = f"host {self.host} is not joined"
            return
        try:
            await self._start(set())
            self.down = ""
        except WorkerLost as e:
            await self.kill()
            self.down = f"lane {self.index} of host {self.host} did not start: {e}"
            log.error("%s; it stays down until the host joins again", self.down)

    async def _remote_plan(self) -> list[tuple[RemoteHost, list[str]]]:
        host = self.hosts.lane_host(self.host)
        if host is None or self.index >= len(host.lanes):
            raise WorkerLost(f"host {self.host} is not joined")
        return [(host, host.lanes[self.index])]

    async def run(self, step: StepF) -> list[ReplyF]:
        if self.down:
            raise WorkerLost(self.down)
        return await super().run(step)

    def can_join(self) -> bool:
        return not self.down and super().can_join()


class NoWorkers:
    """Lane 0 of a head that runs no workers of its own (`lanes = 0`): always down, so all
    work goes to the lanes joined hosts bring. It keeps lane 0's place (the default lane of
    a model placed nowhere) without a device. A `Transport` (core/transport.py)."""

    down = ("this head runs no workers of its own (lanes = 0): work goes to the lanes of "
            "the hosts that join it")

    def __init__(self) -> None:
        self.devices: list[str] = []
        self.model_info: dict = {}
        self.restarts = 0
        self.gaps = GapWindow()
        self._never: asyncio.Future | None = None

    @property
    def exits(self) -> list[asyncio.Future]:
        if self._never is None:
            self._never = asyncio.get_running_loop().create_future()
        return [self._never]

    def dead(self) -> str:
        return ""

    async def start(self) -> None:
        pass

    async def run(self, step: StepF) -> list[ReplyF]:
        raise WorkerLost(self.down)

    def can_join(self) -> bool:
        return False

    def send_join(self, step: StepF) -> asyncio.Future:
        raise WorkerLost(self.down)

    def nudge(self) -> None:
        pass

    async def restart(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def status(self) -> list[dict]:
        return []
