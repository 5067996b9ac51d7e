"""The sample ops the workers are decoding, between the step that brought them and the one
in which they finish.

With sliced sampling (`sample_slice_ms` > 0) a sampling step does not run its samples to
completion: they join the workers' running batches, which decode for one slice (until
sampling's turn is over, or a sample finished), and the step's answer holds only the
samples that finished, of this step or of earlier ones. The core then runs other work (a
training step, say) and comes back with "slice" steps that only go on decoding. So a
tenant's long generation never holds the GPU for its whole length: a short sample
submitted meanwhile joins at the next slice and comes back when it finishes, and training
steps run between the turns (`PendingSamples.in_turn`, asked by core.py).

`PendingSamples` keeps those ops by key (their future's id, which the workers' outcomes
name), feeds a streamed op's reader the new tokens each slice made, hands back the ops
that finished, and drops the ones whose clients went away (the next step tells the
workers, which free their pages). A sample can never be left pending: one that no worker
reports any more, or that a worker-group restart took, fails with a clear error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from twinkled.core.futures import Future
from twinkled.protocol.frames import ReplyF, StepF, as_result

if TYPE_CHECKING:
    from twinkled.core.ops import Op, Outcome
    from twinkled.protocol.types import SampledSequence

GONE = ("server error: no worker holds this sample any more (its worker may have been "
        "restarted): submit it again")
LOST = ("the worker group failed ({why}) and was restarted; this sample was cut short: "
        "submit it again")


@dataclass
class Sliced:
    """What a sampling step's replies say of the samples the workers run, by key."""

    finished: dict[str, Outcome] = field(default_factory=dict)
    running: set[str] = field(default_factory=set)  # still decoding, on some rank
    stocked: bool = False  # some rank holds a batch's worth of rows waiting (SlicedF.stocked)
    pieces: dict[str, list[SampledSequence]] = field(default_factory=dict)  # streamed ones
    lost: str | None = None  # the group failed: every sample it ran is gone, and why

    @classmethod
    def of(cls, replies: list[ReplyF] | str) -> Sliced:
        """From the ranks' replies (a sample runs on one rank, which alone reports it), or
        from why the group failed."""
        if isinstance(replies, str):
            return cls(lost=LOST.format(why=replies))
        out = cls()
        for reply in replies:
            for o in reply.outcomes:
                out.finished[o.key] = (None, o.error, o.category or "server") \
                    if o.error is not None else (as_result(o), None, None)
            if reply.sampling is not None:
                out.running.update(reply.sampling.running)
                out.stocked |= reply.sampling.stocked
                out.pieces.update(reply.sampling.pieces)
        return out


class PendingSamples:
    """The pending ops, and sampling's turns: samples decode for `slice_s` of sampling
    steps, each of which may end early (a sample finished), while training waits; then
    one other step, and the next turn."""

    def __init__(self, slice_s: float, long_s: float = 0.0):
        self.slice_s = slice_s  # a turn (0: a sampling step runs its samples to the end)
        # How long a slice may decode while no other work waits (`step`, config
        # `sample_long_slice_ms`): each slice's end is a round trip to the daemon while the
        # card runs out of queued steps, ~25 ms on the 8B (8 tenants' fan-out: 0.82x the
        # engine alone in slices of 250 ms, 0.90x in slices of 1 s). 0: slices of slice_s.
        self.long_s = long_s
        self._ops: dict[str, Op] = {}  # key (future id) -> the op
        self._cancel: list[str] = []  # keys to drop at the next sampling step
        self._stocked = False  # a worker held a batch's worth of waiting rows, at the last step
        self._turn: float | None = None  # seconds of this turn used (None: it ended)

    @property
    def busy(self) -> bool:
        """Something for the workers: samples to go on with, or to drop."""
        return bool(self._ops or self._cancel)

    @property
    def backlog(self) -> bool:
        """A worker holds as many samples waiting for room as its running batch decodes at
        once: new ones had better wait in the planner's queues (fair share, quotas,
        withdrawal) than in its. Up to that many may wait there, so that a row that
        finishes is replaced at once, without a round trip to the daemon: with new samples
        held back as soon as any waited, the 8B's running batch ran part empty between
        sampling steps (8 tenants' fan-out, H200: 0.81x the engine alone, against 0.91x
        with three times the sample_budget a step)."""
        return self._stocked and bool(self._ops)

    def __len__(self) -> int:
        return len(self._ops)

    def in_turn(self) -> bool:
        """Samples run, and their turn has come (the turn ended before: `end_turn`) or
        is not over yet: training waits."""
        return self.busy and (self._turn is None or self._turn < self.slice_s)

    def end_turn(self) -> None:
        """Another step (training) ran: the samples' next turn comes."""
        self._turn = None

    def spent(self, seconds: float) -> None:
        """A sampling step took `seconds` of the turn."""
        self._turn = (self._turn or 0.0) + seconds

    def step(self, ops: list[Op], alone: bool = False) -> StepF:
        """The next sampling step: `ops` keyed (pending from now; none: a "slice" step),
        the samples to drop, the samplers still in use, and what is left of the turn
        (a new one if the last is over). `alone`: no other work waits, so the slice may
        run on up to `long_s` (work that arrives meanwhile nudges it to end at the turn's
        end, Transport.nudge), unless a reader streams a sample: its tokens come as each
        slice ends."""
        if self._turn is None or self._turn >= self.slice_s:
            self._turn = 0.0
        frames = []
        for op in ops:
            op.frame.key = op.future.id
            op.frame.stream = op.stream is not None
            self._ops[op.future.id] = op
            frames.append(op.frame)
        holds = sorted({op.frame.adapter_id for op in self._ops.values()
                        if op.frame.adapter_id is not None})
        cancel, self._cancel = self._cancel, []
        left = self.slice_s - self._turn
        streams = any(op.stream is not None for op in self._ops.values())
        longest = self.long_s if alone and not streams and left < self.long_s else 0.0
        return StepF(0, "sample" if ops else "slice", frames, left, cancel, holds,
                     slice_max_s=longest)

    def cancel(self, f: Future) -> bool:
        """Stop a pending sample (its client went away); False if it is not pending."""
        if self._ops.pop(f.id, None) is None:
            return False
        self._cancel.append(f.id)
        return True

    def settle(self, sliced: Sliced) -> list[tuple[Op, Outcome]]:
        """What a sampling step's answer settles: streamed tokens go to their readers, and
        the ops that finished (or that no worker holds any more) leave, with outcomes."""
        if sliced.lost is not None:
            return self.lose(sliced.lost)
        self._stocked = sliced.stocked
        for key, partials in sliced.pieces.items():
            op = self._ops.get(key)
            if op is not None and op.stream is not None:
                op.stream(partials)
        done = [(self._ops.pop(key), outcome) for key, outcome in sliced.finished.items()
                if key in self._ops]
        gone = [key for key in self._ops if key not in sliced.running]
        return done + [(self._ops.pop(key), (None, GONE, "server")) for key in gone]

    def lose(self, why: str) -> list[tuple[Op, Outcome]]:
        """Every pending op, failed with `why` (the worker group that ran them is gone)."""
        ops, self._ops, self._cancel, self._stocked = self._ops, {}, [], False
        return [(op, (None, why, "server")) for op in ops.values()]
