"""The sampler against the trainer, watched as the daemon runs: 1 in `every` finished
sampling requests gets its first sequence scored again through the training forward
(Engine.logprob_gap), between steps, and the gap goes back with the worker's next reply
(ReplyF.gaps). The daemon keeps the recent ones (`GapWindow`) for /metrics and `ctl
status`; this module does not import torch, so the daemon's process may import it.

Off the step's path: a pick only notes what it needs when the request is admitted or
finishes; the forward (one pass of prompt + completion) runs in `between_steps`, after the
reply has gone. While samples decode in the running batch that is still on their path (the
next decode step waits for it: 0.1-0.2 s a time on the 8B, ~4% of a sampling bench's
round), so then one check runs at a time and checks take at most `DUTY` of the time;
with the batch idle, every pending one runs. A sample is comparable only at temperature 1 or greedy (others' logprobs
are of the temperature-scaled distribution), and only while its adapter holds the weights
it was sampled with (a sampler checkpoint always does; a training adapter until its next
optimizer step)."""

from __future__ import annotations

import logging
import math
import time
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
DUTY = 0.01  # while samples decode: the share of the worker's time checks may take

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
        self._next = 0.0  # (monotonic) while samples decode, no check before this

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

    @property
    def waiting(self) -> bool:
        """Picked samples wait for their check."""
        return bool(self.pending)

    def run(self, decoding: bool = False) -> None:
        """Score the picked samples (between steps). `decoding`: samples are running (the
        next decode step would wait): one check, and only if the last ones took at most
        DUTY of the time since they began."""
        if not self.pending or (decoding and time.monotonic() < self._next):
            return
        from twinkled.engine.step import HOST_TIME  # (torch: the worker's side only)

        began = time.monotonic()
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
            if decoding:
                break
        now = time.monotonic()
        self._next = now + (now - began) * (1 / DUTY - 1)
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
