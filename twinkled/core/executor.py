"""Planned steps in, outcomes out: the core's only way to the engine.

`Executor` turns a step's ops into frames, runs them on every rank of a worker group (the
`Transport`, transport.py), and merges the ranks' answers into one outcome per op (result,
error message or None, category: replies.py). It journals what changed an adapter before
its client hears of it, and when a worker dies it restarts the group behind the failed
step's answer; bringing the live adapters back at their acknowledged step (persisted state,
then the journal replayed) is the `Restorer`'s (recovery.py). Which adapters are live it
asks of Residency (twinkled/core/residency.py), their one owner. Torch-free.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import NamedTuple, Protocol

from twinkled.core.journal import Journal
from twinkled.core.ops import Outcome
from twinkled.core.recovery import Restorer
from twinkled.core.replies import merge_replies
from twinkled.core.transport import Transport
from twinkled.protocol.frames import (
    RETRY,
    CreateF,
    IdleUnloadF,
    OpF,
    PersistF,
    ReplyF,
    StepF,
    TrainF,
    UnloadF,
    changes_adapter,
    encoder,
)
from twinkled.protocol.types import LoraConfig
from twinkled.workers.gaps import GapWindow
from twinkled.workers.supervisor import WorkerLost

log = logging.getLogger("twinkled")

RESTART_MESSAGE = ("the worker group failed ({why}) and was restarted; this request did not "
                   "run (its model is at its last acknowledged step): submit it again")


class Moved(NamedTuple):
    """A residency move's outcome; whether it ran inside a training step in flight (a
    prefetch, overlapped); the seconds the workers spent on it (what its tenant pays)."""

    outcome: Outcome
    overlapped: bool = False
    seconds: float = 0.0

    @property
    def error(self) -> str | None:
        return self.outcome[1]


class LiveAdapters(Protocol):
    """Who knows which training adapters the workers hold (Residency)."""

    def live_configs(self) -> dict[str, LoraConfig]: ...
    def lost(self, model: str, why: str) -> None: ...


class Executor:
    def __init__(self, group: Transport, live_dir: Path, persist_every: int = 1,
                 journal_fsync: bool = True):
        self.group = group
        self.live_dir = live_dir
        # persist_every = 0 is "persistence off": no write-behind, so no journal either.
        self.journal = Journal(live_dir, enabled=persist_every > 0, fsync=journal_fsync)
        # brings adapters back at their acknowledged step (recovery.py)
        self.restorer = Restorer(group, self.journal, live_dir)
        self._lock = asyncio.Lock()  # one step (or one recovery) at a time
        self._stopping = False
        self.recovering = False  # the group is being restarted (healthz says "restarting")
        # The restart after a failed step, run behind its answer; users of the group wait (`ready`)
        self._recovery: asyncio.Task | None = None
        self._adapters: LiveAdapters | None = None
        self._on_restart: Callable[[], None] = lambda: None
        # Told why the group restarted: who keeps work the workers held across steps (samples)
        self._restart_hooks: list[Callable[[str], None]] = []
        self._unsettled: set[str] = set()  # adapters a failed joined pass may have touched
        # adapters waiting to be restored one by one (`restore_one`), and their answers
        self._restoring: dict[str, tuple[LoraConfig, asyncio.Future]] = {}
        self._restore_task: asyncio.Task | None = None  # (`_restore_waiting`, while any wait)
        self.joined_s = 0.0  # seconds the ranks spent on joins (in the steps they ran in)

    def serve(self, adapters: LiveAdapters, on_restart: Callable[[], None]) -> None:
        """Who to ask which adapters a restarted group must get back, and who counts
        restarts (the metrics)."""
        self._adapters, self._on_restart = adapters, on_restart

    def on_restart(self, hook: Callable[[str], None]) -> None:
        """Call `hook(why)` whenever the worker group is restarted."""
        self._restart_hooks.append(hook)

    def _live(self) -> dict[str, LoraConfig]:
        return self._adapters.live_configs() if self._adapters is not None else {}

    @property
    def model_info(self) -> dict:
        return self.group.model_info

    async def start(self) -> None:
        await self.group.start()

    async def stop(self) -> None:
        self._stopping = True
        async with self._turn():
            await self.group.stop()

    @contextlib.asynccontextmanager
    async def _turn(self) -> AsyncIterator[None]:
        """The group to oneself: the lock, and any restart under way finished first."""
        async with self._lock:
            await self.ready()
            yield

    async def ready(self) -> None:
        """Wait for a restart under way after a failed step (at once when there is none).
        The loop calls it before it plans, so that it plans knowing which adapters came
        back; each use of the group calls it under the lock."""
        task = self._recovery
        if task is None:
            return
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug in restoring: said once; the next step finds the group
            log.exception("restoring the adapters after a worker group restart failed")
        finally:
            if task.done() and self._recovery is task:
                self._recovery = None

    async def watch(self) -> None:
        """Restart the group when a worker dies between steps, before a request notices."""
        while not self._stopping:
            await asyncio.wait(self.group.exits, return_when=asyncio.FIRST_COMPLETED)
            async with self._turn():
                if self.group.dead() and not self._stopping:
                    why = self.group.dead()
                    log.error("worker group lost between steps: %s; restarting it", why)
                    await self.recover(why)

    async def run_ops(self, kind: str, ops: list, micro_tokens: int = 0) -> list[Outcome]:
        """Run one planned step. A worker fault fails the whole step (category "server"),
        answered at once; the group restarts behind the answer, every live adapter
        restored, before anything uses it again. `micro_tokens`: a training step's
        micro-batches hold at most this many tokens; `join` may run ops between them."""
        async with self._turn():
            try:
                return await self._run_ops(kind, ops, micro_tokens)
            finally:
                if self._unsettled and not self.recovering:  # a joined pass that failed
                    models, self._unsettled = self._unsettled, set()
                    await self._reset(models)

    @property
    def preemptible(self) -> bool:
        """Whether training steps may take joins here: a group of one rank (the ranks of
        a bigger one would have to agree on where a join runs)."""
        return len(self.group.devices) == 1

    def can_join(self) -> bool:
        """Whether `join` may run ops now: a training step is in flight on a one-rank
        group (which takes them between its micro-batches)."""
        return not self.recovering and self.group.can_join()

    def may_join(self, model: str) -> bool:
        """Whether ops of `model` may join: not while a failed joined pass left it
        unsettled (it is brought back at its acknowledged state after the step)."""
        return model not in self._unsettled

    def nudge(self) -> None:
        """Work arrived: a sampling slice in flight that may run long ends soon
        (Transport.nudge)."""
        self.group.nudge()

    def join(self, ops: list) -> Awaitable[list[Outcome]]:
        """Send `ops` (a small training step: rows and the optim_steps behind them, of
        models not in the step in flight) into the training step in flight, now; await
        the result for their outcomes, there when they are done, not when that step is.
        Only while `can_join`."""
        frames = self._reserve(ops)
        replies = self.group.send_join(StepF(0, "train", frames, join=True))  # sent now
        return self._outcomes(ops, frames, replies, join=True)

    def _reserve(self, ops: list) -> list[OpF]:
        frames = [op.frame for op in ops]
        for frame in frames:
            if changes_adapter(frame):
                frame.mark = self.journal.reserve(frame.adapter_id)
        return frames

    async def _run_ops(self, kind: str, ops: list, micro_tokens: int = 0) -> list[Outcome]:
        frames = self._reserve(ops)
        replies = self.group.run(StepF(0, kind, frames, micro_tokens=micro_tokens))
        return await self._outcomes(ops, frames, replies)

    async def _outcomes(self, ops: list, frames: list[OpF],
                        replies: Awaitable[list[ReplyF]], join: bool = False
                        ) -> list[Outcome]:
        """The ranks' replies merged into one outcome per op, journaled and on disk before
        any is acknowledged; a lost group fails them all (and restarts behind them)."""
        try:
            got = await replies
            if join:  # the step in flight's time includes it: not the step's own cost
                self.joined_s += max(r.busy_s for r in got)
            merged = await self._merged(frames, got, join)
        except WorkerLost as e:
            message = RESTART_MESSAGE.format(why=e)
            for op in ops:
                self.journal.drop(op.future.id)
            if not join:  # (a join's group is the step in flight's: it restarts it)
                log.error("worker group lost: %s; restarting it", e)
                self._recover_behind(str(e))
            return [(None, message, "server")] * len(ops)
        for op, outcome in zip(ops, merged, strict=True):
            if isinstance(op.frame, UnloadF):  # a model closed for good: nothing to replay
                self.journal.forget(op.frame.adapter_id)
            self._journal(op, outcome)
        await self.journal.flush()  # on disk before any of them is acknowledged
        return merged

    async def run_samples(self, step: StepF) -> list[ReplyF] | str:
        """A sampling step (pending_samples.py says what it holds): the ranks' replies, or
        why the group failed (it is restarted; the samples it ran are gone)."""
        async with self._turn():
            try:
                return await self.group.run(step)
            except WorkerLost as e:
                log.error("worker group lost: %s; restarting it", e)
                self._recover_behind(str(e))
                return str(e)

    async def _merged(self, frames: list[OpF], replies: list[ReplyF],
                      join: bool = False) -> list[Outcome]:
        self.restorer.note_persisted(replies)
        merged = merge_replies(frames, replies)
        retry = [i for i, m in enumerate(merged) if m[2] == RETRY]
        if retry and join:
            # The joined pass failed (out of memory, say): its adapters may hold part of
            # its gradients. They are restored once the step in flight is done (run_ops);
            # until then none of their ops joins again.
            self._unsettled |= {frames[i].adapter_id for i in retry
                                if isinstance(frames[i], TrainF)} - {None}
            for i in retry:
                merged[i] = (None, f"this request failed in the engine ({merged[i][1]}); "
                             "submit it again", "server")
        elif retry:
            await self._isolate(frames, merged, retry)
        return merged

    async def _isolate(self, frames: list[OpF], merged: list[Outcome], retry: list[int]) -> None:
        """A shared pass failed (an out-of-memory error, say): its adapters may hold part of
        its gradients. Bring them back to their acknowledged state, then run the pass's ops
        one at a time: an op that fails alone fails alone (its adapter restored again)."""
        trained = {frames[i].adapter_id for i in retry if isinstance(frames[i], TrainF)}
        log.warning("a shared step failed (%s); running its %d ops one at a time",
                    merged[retry[0]][1], len(retry))
        await self._reset(trained - {None})
        for i in retry:
            frame = frames[i]
            outcome = await self.restorer.run_one(frame)
            if outcome[2] == RETRY:
                await self._reset({frame.adapter_id} - {None})
                outcome = (None, f"this request failed in the engine: {outcome[1]}", "user")
            merged[i] = outcome

    async def _reset(self, models: set[str]) -> None:
        live = self._live()
        failed = await self.restorer.restore_frames({m: live[m] for m in models if m in live})
        self._lost(failed)

    def _lost(self, failed: dict[str, str]) -> None:
        for model, why in failed.items():
            log.error("adapter %s could not be restored: %s", model, why)
            if self._adapters is not None:
                self._adapters.lost(model, why)

    def _journal(self, op, outcome: Outcome) -> None:
        """Record an op that changed its adapter, before its client hears it is done. The
        pieces of a cut forward_backward are recorded together, once the last one ran."""
        frame, piece = op.frame, op.piece
        if outcome[1] is not None:
            if piece is not None:
                self.journal.drop(op.future.id)
            return
        if not changes_adapter(frame) or not frame.mark or isinstance(frame, CreateF):
            return  # nothing to replay (a restore re-creates a new adapter from its seed)
        model = frame.adapter_id
        data = encoder.encode(frame)
        if piece is None:
            self.journal.record(model, frame.mark, data, op.future.id)
            return
        self.journal.hold(op.future.id, model, frame.mark, data)
        if piece[1]:
            self.journal.commit(op.future.id)

    async def recover(self, why: str = "a worker was lost") -> None:
        """Restart the group until it comes up, then restore the live adapters."""
        self._lose_group(why)
        await self._restart()

    def _recover_behind(self, why: str) -> None:
        """Start `recover` without waiting for it: the failed step's clients hear of it
        now, not after the group has loaded the model again (a minute on a big model)."""
        self._lose_group(why)
        self._recovery = asyncio.get_running_loop().create_task(self._restart())

    def _lose_group(self, why: str) -> None:
        self.recovering = True
        for hook in self._restart_hooks:  # what the dead group held is gone already
            hook(why)

    async def _restart(self) -> None:
        delay = 1.0
        try:
            while True:
                try:
                    await self.group.restart()
                    self._on_restart()
                    self._lost(await self.restorer.restore(self._live()))
                    return
                except WorkerLost as e:
                    if self._stopping:  # a shutdown waits for this: stop retrying
                        return
                    log.error("worker group restart failed: %s; retrying in %.0f s", e, delay)
                    await asyncio.sleep(delay)
                    delay = min(30.0, 2 * delay)
        finally:
            self.recovering = False

    async def restore(self, adapters: dict[str, LoraConfig]) -> dict[str, str]:
        """Bring adapters back at their acknowledged step (`Restorer.restore`); {model id:
        why} for those that could not be."""
        return await self.restorer.restore(adapters)

    async def unload_idle(self, model: str) -> None:
        """Persist an idle adapter and free its memory; `restore` brings it back."""
        async with self._turn():
            replies = await self.group.run(
                StepF(0, "barrier", [IdleUnloadF(model)]))
            self.restorer.note_persisted(replies)

    async def move(self, frame: OpF, overlap: bool = False) -> Moved:
        """One residency move (a ParkF, UnparkF or IdleUnloadF: core/tiers.py); `moves`."""
        return (await self.moves([frame], overlap))[0]

    async def moves(self, frames: list[OpF], overlap: bool = False) -> list[Moved]:
        """Residency moves on every rank, in one frame (a park of many adapters costs one
        round trip, not one each). With `overlap` they may run inside the training step in
        flight (ParkF and UnparkF on a one-rank group, between two micro-batches: the step
        does not wait for them, nor they for the step); those that cannot run there (no
        free bank slot) run between steps. Each move is charged its share of the time."""
        moved: list[Moved | None] = [None] * len(frames)
        if overlap and self.can_join():
            try:
                replies = await self.group.send_join(StepF(0, "barrier", frames, join=True))
            except WorkerLost as e:
                return [Moved((None, str(e), "server"), True)] * len(frames)
            self.restorer.note_persisted(replies)  # (writes the rank finished meanwhile)
            busy = max(r.busy_s for r in replies) / len(frames)
            self.joined_s += busy * len(frames)  # the step in flight's time holds it
            for i, outcome in enumerate(merge_replies(frames, replies)):
                if outcome[1] is None:
                    moved[i] = Moved(outcome, True, busy)
        again = [f for f, m in zip(frames, moved, strict=True) if m is None]
        if again:
            async with self._turn():
                replies = await self.group.run(StepF(0, "barrier", again))
                self.restorer.note_persisted(replies)
            busy = max(r.busy_s for r in replies) / len(again)
            outcomes = iter(merge_replies(again, replies))
            moved = [m or Moved(next(outcomes), False, busy) for m in moved]
        return moved

    async def restore_one(self, model: str, config: LoraConfig) -> Moved:
        """Bring one adapter back between steps (its error: the reason if it could not be).
        Those asked for while the group is busy are restored together, in one round trip
        (a turn of a 1,000-run bench brings in dozens a step), by a task of the executor's
        own: a request that goes away meanwhile costs the others nothing."""
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        self._restoring[model] = (config, answer)
        if self._restore_task is None or self._restore_task.done():
            self._restore_task = loop.create_task(self._restore_waiting())
        return await asyncio.shield(answer)

    async def _restore_waiting(self) -> None:
        """Restore the adapters asked for (`restore_one`), those asked meanwhile together,
        until none is left."""
        while self._restoring:
            async with self._turn():
                batch, self._restoring = self._restoring, {}
                began = time.monotonic()
                try:
                    failed = await self.restorer.restore({m: c for m, (c, _) in batch.items()})
                except BaseException as e:  # (each caller hears it from its answer)
                    stopped = isinstance(e, asyncio.CancelledError)
                    for _, f in batch.values():
                        if not f.done():
                            f.cancel() if stopped else f.set_exception(e)
                    if stopped:
                        raise
                    continue
                seconds = (time.monotonic() - began) / len(batch)
                for m, (_, f) in batch.items():
                    why = failed.get(m)
                    if not f.done():
                        f.set_result(Moved((None, why, "server" if why else None), False,
                                           seconds))

    def take_rollback(self, model: str) -> str | None:
        """What a model's client must be told once: its run lost acknowledged steps."""
        return self.restorer.take_rollback(model)

    async def persist_all(self) -> None:
        """Every live adapter's weights and optimizer state on disk (for a hot restart)."""
        frames = [PersistF(m) for m in self._live()]
        if frames:
            async with self._turn():
                self.restorer.note_persisted(await self.group.run(StepF(0, "barrier", frames)))

    def status(self) -> dict:
        return {"workers": self.group.status(), "restarts": self.group.restarts}

    @property
    def gaps(self) -> GapWindow:
        """The sampler vs trainer logprob gaps the group's workers measured."""
        return self.group.gaps
