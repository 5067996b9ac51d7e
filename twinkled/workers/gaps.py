"""The sampler against the trainer, watched as the daemon runs: 1 in `every` finished
sampling requests gets its first sequence scored again through the training forward
(Engine.logprob_gap), between steps, and the gap goes back with the worker's next reply
(ReplyF.gaps). The daemon keeps the recent ones (`GapWindow`) for /metrics and `ctl
status`; this module does not import torch, so the daemon's process may import it.

Off the step's path: a pick only notes what it needs when the request is admitted or
finishes; the forward (one pass of prompt + completion) runs in `between_steps`, after the
reply has gone. A sample is comparable only at temperature 1 or greedy (others' logprobs
are of the temperature-scaled distribution), and only while its adapter holds the weights
it was sampled with (a sampler checkpoint always does; a training adapter until its next
optimizer step)."""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from twinkled.protocol.frames import ReplyF
from twinkled.protocol.types import LogprobGap, SampledSequence, SampleRequest

if TYPE_CHECKING:
    from twinkled.engine import Engine

log = logging.getLogger("twinkled.worker")

PENDING = 4  # picked samples waiting for their forward; older ones are dropped
WINDOW = 64  # the daemon's recent figure is over this many checked samples (per group)

# (adapter id, prompt, the adapter's optimizer steps when it was sampled)
_Pick = tuple[str | None, list[int], int]


class GapChecks:
    def __init__(self, engine: Engine, every: int):
        self.engine = engine
        # A split model (tensor or expert parallel) runs its forward as a collective of
        # the group: between steps, ranks are not in step, so it is not checked.
        self.every = every if engine.shard is None and engine.experts is None else 0
        self.seen = 0  # comparable requests so far (the 1st, then every `every`-th, is picked)
        self.watched: dict[int, _Pick] = {}  # running-batch ticket -> its pick
        self.pending: deque[tuple[_Pick, SampledSequence]] = deque(maxlen=PENDING)
        self.done: list[LogprobGap] = []

    def _pick(self, req: SampleRequest) -> _Pick | None:
        # (A prompt with images: the trainer's scoring here is of its tokens alone.)
        if self.every <= 0 or req.params.temperature not in (0.0, 1.0) or req.images:
            return None
        self.seen += 1
        if (self.seen - 1) % self.every:
            return None
        aid = req.adapter_id
        return aid, list(req.prompt), 0 if aid is None else self.engine.adapter_info(aid).steps

    def admitted(self, ticket: int, req: SampleRequest) -> None:
        """A request joined the running batch as `ticket`."""
        pick = self._pick(req)
        if pick is not None:
            self.watched[ticket] = pick

    def finished(self, ticket: int, sequences: list[SampledSequence] | None) -> None:
        """`ticket` finished (None: it was cancelled or failed)."""
        pick = self.watched.pop(ticket, None)
        if pick is not None and sequences:
            self.pending.append((pick, sequences[0]))

    def sampled(self, req: SampleRequest, sequences: list[SampledSequence]) -> None:
        """A request sampled whole (not in the running batch)."""
        pick = self._pick(req)
        if pick is not None and sequences:
            self.pending.append((pick, sequences[0]))

    def run(self) -> None:
        """Score the picked samples (between steps)."""
        if not self.pending:
            return
        from twinkled.engine.step import HOST_TIME  # (torch: the worker's side only)

        while self.pending:
            (aid, prompt, steps), seq = self.pending.popleft()
            if not seq.tokens or (aid is not None and (
                    not self.engine.has_adapter(aid)
                    or self.engine.adapter_info(aid).steps != steps)):
                continue  # nothing generated, or the weights it was sampled with are gone
            try:
                gap = self.engine.logprob_gap(aid, prompt, seq.tokens, seq.logprobs)
            except Exception:  # a monitor: it must never take the worker down
                log.exception("the sampler/trainer logprob check failed")
                continue
            if math.isfinite(gap.mean):
                self.done.append(gap)
        HOST_TIME.take()  # the checks' passes are no part of the next step's trace

    def take(self) -> list[LogprobGap]:
        """The gaps measured since the last call (for the next reply)."""
        done, self.done = self.done, []
        return done


class GapWindow:
    """The daemon's side: the last WINDOW gaps a worker group's replies carried, and how
    many were measured since the daemon started."""

    def __init__(self) -> None:
        self.recent: deque[LogprobGap] = deque(maxlen=WINDOW)
        self.checked = 0

    def add(self, replies: Iterable[ReplyF]) -> None:
        for r in replies:
            self.recent.extend(r.gaps)
            self.checked += len(r.gaps)

    @staticmethod
    def summary(windows: Iterable[GapWindow]) -> dict:
        """Over every group's recent gaps: the mean per token (weighted by tokens), the
        largest one token's, in nats (None before any check), how many samples that is and
        how many were checked in all."""
        windows = list(windows)
        recent = [g for w in windows for g in w.recent]
        tokens = sum(g.tokens for g in recent)
        return {"mean": sum(g.mean * g.tokens for g in recent) / tokens if tokens else None,
                "max": max((g.max for g in recent), default=None),
                "window": len(recent), "checked": sum(w.checked for w in windows)}
