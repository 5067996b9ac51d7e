"""Bringing adapters back at their acknowledged step, after a worker group restarted or a
shared pass failed: each adapter's newest persisted state (written by the workers behind
the steps), then the journal's ops after it, run again in order. An op that cannot be run
again leaves its run where it got to, and its client is told once, on its next request
(`take_rollback`), never silently.

The `Executor` (executor.py) owns the worker group and the lock; it calls this between
steps, under that lock.
"""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec

from twinkled.core.journal import Journal
from twinkled.core.ops import Outcome
from twinkled.core.replies import merge_replies
from twinkled.core.transport import Transport
from twinkled.protocol.frames import OpF, ReplyF, RestoreF, StepF, TrainF, op_decoder
from twinkled.protocol.types import LoraConfig

log = logging.getLogger("twinkled")


class Restorer:
    def __init__(self, group: Transport, journal: Journal, live_dir: Path):
        self.group = group
        self.journal = journal
        self.live_dir = live_dir
        # model -> what its client is told on its next request: its run was rolled back
        self.rollbacks: dict[str, str] = {}

    async def restore(self, adapters: dict[str, LoraConfig]) -> dict[str, str]:
        """Bring adapters back at their acknowledged step: the persisted state, then the
        journal's ops after it (fresh if they have neither). Returns {model id: why} for
        those that could not be restored at all (the caller decides what they become)."""
        for model in adapters:
            if not self.journal.loaded(model):
                self.journal.load(model)
        return await self.restore_frames(adapters)

    async def restore_frames(self, adapters: dict[str, LoraConfig]) -> dict[str, str]:
        """`restore` for adapters whose journal is loaded already (a failed pass's)."""
        if not adapters:
            return {}
        frames = [RestoreF(m, c, str(self.live_dir)) for m, c in adapters.items()]
        replies = await self.group.run(StepF(0, "barrier", frames))
        marks = {frames[o.index].adapter_id: o.mark or 0 for o in replies[0].outcomes}
        failed = {}
        for frame, outcome in zip(frames, merge_replies(frames, replies), strict=True):
            if outcome[1] is not None:
                failed[frame.adapter_id] = outcome[1]
        for model, mark in marks.items():
            if model not in failed:
                await self._replay(model, mark)
        return failed

    async def _replay(self, model: str, mark: int) -> None:
        """Run again the journaled ops of `model` after position `mark`, in order. If one
        fails, the run stays where it got to, and its client is told on its next request."""
        entries = self.journal.since(model, mark)
        done = 0
        for entry in entries:
            try:
                frame = op_decoder.decode(entry.frame)
            except msgspec.DecodeError as e:  # written by another version of the daemon
                error = f"a journaled operation could not be read: {e}"
            else:
                _, error, _ = await self.run_one(frame)
            if error is not None:
                self.rollbacks[model] = (
                    f"model {model} was restored after a failure, but {len(entries) - done} "
                    f"acknowledged operation(s) could not be replayed ({error}); it is at the "
                    f"state after {done} of them: check its last checkpoint before going on")
                log.error("%s", self.rollbacks[model])
                self.journal.discard_after(model, mark)  # never replayed onto later state
                break
            done += 1
            mark = entry.mark
        self.journal.resume(model, mark)
        if done:
            log.info("adapter %s: replayed %d journaled op(s)", model, done)

    async def run_one(self, frame: OpF) -> Outcome:
        """One op alone on the group (a replay, or an op of a failed shared pass)."""
        kind = "train" if isinstance(frame, TrainF) else "barrier"
        replies = await self.group.run(StepF(0, kind, [frame]))
        self.note_persisted(replies)
        return merge_replies([frame], replies)[0]

    def note_persisted(self, replies: list[ReplyF]) -> None:
        """The versions the ranks wrote: the journal may forget the ops they hold."""
        for reply in replies:
            for model, mark in reply.persisted.items():
                self.journal.persisted(model, mark)

    def take_rollback(self, model: str) -> str | None:
        """What a model's client must be told once: its run lost acknowledged steps."""
        return self.rollbacks.pop(model, None)
