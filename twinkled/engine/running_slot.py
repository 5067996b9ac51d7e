"""An engine's running batch (running.py) from one sampling call to the next.

It is made at the first sample, sized for what is asked whenever it is idle, and kept, with
its KV page pool, its cached prompt prefixes and its decode step's CUDA graphs, for the
calls after. It is dropped when it can no longer be trusted: a failed step may leave rows
holding pages, and a full run's optimizer step changes the base weights its cached prefixes
were computed with (the engine says when: `drop`).
"""

from __future__ import annotations

from collections.abc import Callable

from twinkled.protocol.types import SampledSequence, SampleRequest, SampleResult

from . import sampler
from .lora import Adapter
from .model import BaseModel
from .running import Finished, RunningBatch


class RunningSlot:
    """`rows`: sequences decoded at once; `prefix_cache`: the pool's share prompts stay
    cached in (0: off)."""

    def __init__(self, model: BaseModel, rows: int, prefix_cache: float):
        self.model, self.rows, self.prefix_cache = model, rows, prefix_cache
        self._batch: RunningBatch | None = None
        self._finished: list[Finished] = []  # submitted requests done during `generate`

    def batch_for(self, requests: list[SampleRequest], kv_bytes: int | None) -> RunningBatch:
        """The batch `requests` join: the kept one, or a new one with a pool of `kv_bytes`
        (None: the device's default); an idle one is first sized to hold them (a batch in
        use cannot grow: `admit` refuses what it cannot hold)."""
        batch = self._batch or RunningBatch(self.model, self.rows, kv_bytes=kv_bytes,
                                            prefix_cache=self.prefix_cache)
        if batch.idle:
            batch = batch.sized_for(requests)
        self._batch = batch
        return batch

    def generate(self, batch: RunningBatch, requests: list[SampleRequest],
                 adapters: list[Adapter | None]) -> list[SampleResult]:
        """Sample `requests` to the end in `batch`; submitted requests that finish meanwhile
        wait for `run`."""
        try:
            return sampler.generate(self.model, requests, adapters, batch=batch,
                                    others=self._finished)
        except BaseException:
            self._batch = None  # rows may be left holding pages: start afresh next time
            raise

    def run(self, max_steps: int | None, max_seconds: float | None, until_done: bool,
            min_seconds: float, stop: Callable[[], bool] | None = None) -> list[Finished]:
        """A decode slice of the submitted requests (RunningBatch.run), with those that
        finished during a `generate` first. If a step fails, every queued request is lost
        (the batch starts afresh) and the error propagates."""
        done, self._finished = self._finished, []
        if self._batch is None or (until_done and done):
            return done
        try:
            return done + self._batch.run(max_steps, max_seconds, until_done, min_seconds,
                                          stop)
        except BaseException:
            self._batch = None
            raise

    def drop(self, only_idle: bool = False) -> None:
        """Forget the batch (with `only_idle`, only if nothing runs in it): the next sample
        makes a new one."""
        if not only_idle or self.idle:
            self._batch = None

    @property
    def pages(self) -> int:
        return 0 if self._batch is None else self._batch.pool.pages

    @property
    def idle(self) -> bool:
        return self._batch is None or self._batch.idle

    @property
    def waiting(self) -> int:
        return 0 if self._batch is None else self._batch.waiting_requests

    @property
    def stocked(self) -> bool:
        """Rows wait for room, as many as the batch decodes at once: whatever finishes
        next, a waiting request takes its place."""
        b = self._batch
        return b is not None and b.waiting_rows >= b.rows

    def partials(self, tickets: list[int] | None = None) -> dict[int, list[SampledSequence]]:
        return {} if self._batch is None else self._batch.partials(tickets)

    def pieces(self) -> dict[int, list[list[int]]]:
        return {} if self._batch is None else self._batch.pieces()

    def cancel(self, ticket: int) -> bool:
        return self._batch is not None and self._batch.cancel(ticket)

    def fits(self, request: SampleRequest) -> bool:
        b = self._batch
        return b is None or b.idle or b.fits(request)
