"""Runs one step frame on this rank's engine and says what came of each op.

Every rank gets the same step (SPMD). Checks run on every rank over the whole step, so all
ranks agree on which ops fail (category "user") before any row trains. Then:
  train:   the rows of the good ops are split across ranks by tokens; each rank runs its
           share; gradients are summed over the group at the optimizer step (engine);
  sample:  whole sampling requests are split across ranks by cost;
  barrier: every rank runs every op (adapters stay identical on all ranks); only rank 0
           writes checkpoint files and persists live state.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from twinkled.engine import Engine, EngineInputError
from twinkled.engine.context_parallel import ContextParallel
from twinkled.engine.live import read_mark
from twinkled.engine.parallel import split_rows
from twinkled.protocol.blobs import Blobs
from twinkled.protocol.frames import (
    RETRY,
    CreateF,
    DatumF,
    FwdBwdOutF,
    IdleUnloadF,
    LoadF,
    OpF,
    OptimF,
    OutcomeF,
    ParkF,
    PersistF,
    RestoreF,
    SaveF,
    SlicedF,
    StepF,
    TrainF,
    UnloadF,
    UnparkF,
)
from twinkled.protocol.prefixes import datum_costs
from twinkled.protocol.types import Datum, ForwardBackwardRequest, LogprobGap

from .parked import HostTier
from .patch_cache import PATCHES
from .persist import Persister, SplitPersistence, latest_version
from .rank_io import anywhere, category, fatal, release, to_buf, to_tensor
from .sampling import SampleRunner
from .share import readable

log = logging.getLogger("twinkled.worker")

# Fault tests only: a pass holding a datum of this many tokens fails after its backward.
_FAIL_TOKENS = int(os.environ.get("TWINKLED_TEST_FAIL_TOKENS", "0"))


def _without(result, datums: list[int], drop: set[int]):
    """An op's result less the datums another rank reports (a split row's), and the
    datums it still holds."""
    if not drop:
        return result, datums
    keep = [k for k, j in enumerate(datums) if j not in drop]
    outputs = [result.outputs[k] for k in keep]
    metrics = dict(result.metrics)
    metrics["loss:sum"] = float(sum(o["elementwise_loss"].sum() for o in outputs))
    return replace(result, outputs=outputs, metrics=metrics), [datums[k] for k in keep]


def _datum(d: DatumF) -> Datum:
    return Datum(to_tensor(d.tokens), {k: to_tensor(v) for k, v in d.inputs.items()},
                 images=[PATCHES.get(i) for i in d.images])


class StepRunner:
    def __init__(self, engine: Engine, rank: int, world: int, persister: Persister | None,
                 spans_hosts: bool = False, ep: int = 1, seed: int | None = None,
                 persist_every: int = 1, gap_every: int = 0,
                 cp: ContextParallel | None = None, blobs: Blobs | None = None,
                 host_max_bytes: int | None = None):
        """`host_max_bytes`: what adapters parked in host memory may take (HostTier)."""
        self.engine = engine
        self.blobs = blobs or Blobs.from_spec(None)  # where checkpoints live (protocol/blobs.py)
        # Context parallelism (engine/context_parallel.py): a long row runs on every rank
        # of one group of cp.size ranks, which its first rank reports; the other rows are
        # split over all ranks as data parallelism splits them.
        self.cp = cp
        self.rank, self.world = rank, world
        # Rows and samples are split over the data-parallel replicas; every rank of a
        # replica runs the same ones, and one rank of it reports them (the executor joins
        # what ranks say). A replica is a tensor-parallel group (engine/tp.py) or an expert
        # group of `ep` ranks (engine/moe_parallel.py). Unseeded samples get seeds from
        # `seed` (the same on every rank), so an expert group's ranks draw the same tokens.
        shard = engine.shard
        if shard is not None:
            self.replica, self.replicas = shard.tp.dp_rank, shard.tp.dp_size
            self.reports = shard.rank == 0
        else:
            self.replica, self.replicas = rank // ep, world // ep
            self.reports = rank % ep == 0
        self.persister = persister  # rank 0 only
        # Split adapters are persisted by every rank together (a gather), on rank 0's word.
        self.split = None if shard is None else SplitPersistence(
            engine, persister, persist_every, self.replica)
        self.spans_hosts = spans_hosts  # rank 0's files are shared to the others (share.py)
        self.sampling = SampleRunner(engine, rank, self.replica, self.replicas, self.reports,
                                     spans_hosts, seed, gap_every, self.blobs)
        # Per adapter: the journal position of the last op after which it had no pending
        # gradients (what a snapshot of it holds; twinkled/core/journal.py).
        self.marks: dict[str, int] = {}
        # adapters parked in host memory (parked.py; a cp rank's `pending` misses split rows)
        self.parked = HostTier(engine, host_max_bytes, exact_pending=cp is None)
        self._grow = True  # an unpark may grow a bank (not inside a step in flight)

    def run(self, step: StepF, between: Callable[[], None] | None = None,
            joined: bool = False, nudged: Callable[[], bool] | None = None
            ) -> list[OutcomeF]:
        """Every op gets an outcome; an exception leaves only if the rank cannot go on.
        `between`: called between a training step's micro-batches (the worker runs the
        "join" steps sent meanwhile there); `joined`: this step runs inside another one
        (whose ops are not answered yet: an adapter brought in there takes a free bank
        slot only, so no buffer of that step moves); `nudged`: whether the daemon said
        that work arrived (a long sampling slice then ends: SampleRunner.run)."""
        grow, self._grow = self._grow, not joined
        try:
            return self._run(step, between, joined, nudged)
        finally:
            self._grow = grow

    def _run(self, step: StepF, between: Callable[[], None] | None, joined: bool,
             nudged: Callable[[], bool] | None = None) -> list[OutcomeF]:
        if self.persister is not None and not joined:  # the steps before were all answered
            self.persister.confirm()
        if step.kind in ("sample", "slice"):
            return self.sampling.run(step, nudged)
        rows = [i for i, op in enumerate(step.ops) if isinstance(op, TrainF)]
        barriers = [i for i, op in enumerate(step.ops) if not isinstance(op, TrainF)]
        outcomes = self._train(step.ops, rows, step.micro_tokens, between) if rows else []
        failed = any(o.category == RETRY for o in outcomes)
        if rows and self.world > 1:
            # Rows are split, so a pass may fail on some ranks only; all must agree before
            # any enters the collectives that follow (an optim_step's all-reduce), which
            # a rank that stopped here would never join.
            failed = anywhere(failed, self.engine.model.device)
        if failed:
            # The pass failed: the step's barriers (optim_steps behind its rows) wait too.
            return sorted(outcomes + [OutcomeF(i, error="not run", category=RETRY)
                                      for i in barriers], key=lambda o: o.index)
        if barriers:
            outcomes += self._barriers(step.ops, barriers)
        if self.split is not None:  # every rank, at the same point of the same step
            self.split.pump(self.marks)
        return sorted(outcomes, key=lambda o: o.index)

    def sampling_news(self, step: StepF) -> SlicedF | None:
        """After a sampling step: the samples still running here, and streamed tokens."""
        return self.sampling.news() if step.kind in ("sample", "slice") else None

    def gaps(self) -> list[LogprobGap]:
        """Sampler vs trainer logprob gaps measured since the last reply."""
        return self.sampling.gaps.take()

    def persisted(self) -> dict[str, int]:
        """{adapter: journal mark} of the states written since the last reply."""
        return self.persister.take_written() if self.persister is not None else {}

    # -- forward/backward ---------------------------------------------------------------

    def _train(self, ops: list[OpF], indices: list[int], micro_tokens: int = 0,
               between: Callable[[], None] | None = None) -> list[OutcomeF]:
        outcomes, good = [], []
        PATCHES.warm(im for i in indices for d in ops[i].data for im in d.images)
        for i in indices:
            f = ops[i]
            if f.adapter_id is not None and not self.engine.has_adapter(f.adapter_id):
                # The daemon sends only what it checked is loaded (ensure_loaded): here its
                # bookkeeping and this worker's disagree, a fault of ours, not the client's.
                outcomes.append(OutcomeF(i, error=f"adapter_id: no adapter {f.adapter_id!r} "
                                         "is loaded on the worker (a server fault); submit "
                                         "the request again", category="server"))
                continue
            good.append((i, ForwardBackwardRequest(f.adapter_id, [_datum(d) for d in f.data],
                                                   f.loss_fn, f.loss_config, f.forward_only)))
        rows = [(i, req, j) for i, req in good for j in range(len(req.data))]
        # A prompt's rollouts stay on one replica, so their prompt is computed once.
        minimum = self.engine.shared_prefix if self.engine.packed else 0
        costs, follows = [], []
        for i, _ in good:
            parts = datum_costs(ops[i], minimum)  # less than its length: shares with the last
            costs += parts
            follows += [j > 0 and c < d.tokens.shape[0]
                        for j, (c, d) in enumerate(zip(parts, ops[i].data, strict=True))]
        long = [self.cp is not None and self.cp.splits(ops[i].data[j].tokens.shape[0])
                for i, _, j in rows]
        mine = self._mine(rows, costs, follows, long)
        run = [(i, req) for i, req in good if mine[i]]
        try:  # checked at the door: the engine does not check again
            results = self.engine.forward_backward(
                [replace(req, data=[req.data[j] for j in mine[i]]) for i, req in run],
                checked=True, micro_tokens=micro_tokens,
                between=between if self.world == 1 else None, cp=self.cp)
            if _FAIL_TOKENS and any(len(req.data[j].tokens) == _FAIL_TOKENS
                                    for i, req in run for j in mine[i]):
                raise RuntimeError("injected failure (TWINKLED_TEST_FAIL_TOKENS)")
        except Exception as e:
            if fatal(e, self.engine.shard is not None):
                raise
            release(e)
            why = f"{type(e).__name__}: {e}"
            return outcomes + [OutcomeF(i, error=why, category=RETRY) for i, _ in good]
        by_op = dict(zip([i for i, _ in run], results, strict=True))
        split = {(i, j) for (i, _, j), s in zip(rows, long, strict=True) if s}
        for i, _ in good:
            r = by_op.get(i) if self.reports else None
            rows_i = mine[i] if self.reports else []
            if r is not None and split and self.cp.rank != 0:  # the group's first rank's word
                r, rows_i = _without(r, mine[i], {j for k, j in split if k == i})
            out = FwdBwdOutF(rows_i, [], {}) if r is None else FwdBwdOutF(
                rows_i, [{k: to_buf(v) for k, v in o.items()} for o in r.outputs], r.metrics)
            outcomes.append(OutcomeF(i, fwdbwd=out))
        return outcomes

    def _mine(self, rows: list, costs: list[int], follows: list[bool], long: list[bool]
              ) -> dict[int, list[int]]:
        """The datums of each op this rank runs: its share of the rows split over the
        replicas by tokens and, under context parallelism, the long rows of its group (long
        rows split over the groups by tokens)."""
        short = [k for k, s in enumerate(long) if not s]
        # (a row follows the one before it only where that one is not split)
        chain = [follows[k] and not (k and long[k - 1]) for k in short]
        owner = {k: r for k, r in zip(short, split_rows(
            [costs[k] for k in short], self.replicas, chain), strict=True)}
        if len(short) < len(rows):
            groups = self.world // self.cp.size
            split = [k for k, s in enumerate(long) if s]
            mine_group = self.rank // self.cp.size
            for k, g in zip(split, split_rows([costs[k] for k in split], groups), strict=True):
                owner[k] = self.replica if g == mine_group else -1
        mine: dict[int, list[int]] = {i: [] for i, *_ in rows}
        for k, (i, _, j) in enumerate(rows):
            if owner[k] == self.replica:
                mine[i].append(j)
        return mine

    # -- barriers -----------------------------------------------------------------------

    def _barriers(self, ops: list[OpF], indices: list[int]) -> list[OutcomeF]:
        optims = [i for i in indices if isinstance(ops[i], OptimF)]
        outcomes = [self._one(i, ops[i]) for i in indices if not isinstance(ops[i], OptimF)]
        if not optims:
            return outcomes
        try:  # several models' optimizer steps as one engine call
            results = self.engine.optim_steps([(ops[i].adapter_id, ops[i].params) for i in optims])
            stepped = [OutcomeF(i, optim=r) for i, r in zip(optims, results, strict=True)]
        except EngineInputError:  # one bad step: run them one by one to blame the right one
            stepped = [self._one(i, ops[i]) for i in optims]
        for o in stepped:
            if o.optim is not None:
                self.marks[ops[o.index].adapter_id] = ops[o.index].mark
                if o.optim.applied:
                    self._persist(ops[o.index].adapter_id, every=True)
        return outcomes + stepped

    def _persist(self, adapter_id: str, every: bool = False, now: bool = False) -> None:
        """`every`: after an optimizer step (persist_every decides); `now`: before a flush.
        Not a full-parameter run: its live state is the journal (replayed over the base
        model after a restart), as an adapter's is between its persisted versions."""
        if self.engine.is_full(adapter_id):
            return
        if self.split is not None:
            if now:
                self.split.now(adapter_id, self.marks.get(adapter_id, 0))
            elif every:
                self.split.stepped(adapter_id)
            else:
                self.split.changed(adapter_id)
            return
        if self.persister is None:
            return
        if every:
            self.persister.after_step(adapter_id, self.engine.pool.get(adapter_id))
        else:
            self.persister.mark(adapter_id)

    def _flush(self) -> bool:
        return self.persister is None or self.persister.flush(self.engine.pool.adapters,
                                                             self.marks)

    def between_steps(self) -> bool:
        """Check the samples picked for the logprob gap (gaps.py), and persist what
        changed, if the writer is free; True while something waits."""
        gaps = self.sampling.gaps
        gaps.run(decoding=not self.engine.sample_idle)
        if self.persister is None:
            return gaps.waiting
        self.persister.pump(self.engine.pool.adapters, self.marks)
        return bool(self.persister.dirty) or gaps.waiting

    def _one(self, i: int, op: OpF) -> OutcomeF:
        """A barrier op, on every rank; its failure is its own (a save or load changed
        nothing)."""
        try:
            return self._barrier(i, op)
        except Exception as e:
            if fatal(e, self.engine.shard is not None):
                raise
            return OutcomeF(i, error=str(e) if isinstance(e, EngineInputError)
                            else f"{type(e).__name__}: {e}", category=category(e))

    def _barrier(self, i: int, op: OpF) -> OutcomeF:
        engine, aid = self.engine, op.adapter_id
        match op:
            case CreateF(config=config):
                engine.add_adapter(aid, config)
                self.marks[aid] = op.mark
                if config.seed is None:  # (else its seed makes it again: a restore's)
                    self._persist(aid)
                return OutcomeF(i, info=engine.adapter_info(aid))
            case RestoreF():
                info, mark = self._restore(aid, op)
                return OutcomeF(i, info=info, mark=mark)
            case OptimF(params=params):
                result = engine.optim_step(aid, params)
                self.marks[aid] = op.mark
                if result.applied:
                    self._persist(aid, every=True)
                return OutcomeF(i, optim=result)
            case SaveF():
                if op.sampler:
                    try:
                        self.sampling.keep_fresh(aid, op.dir)
                    except Exception as e:  # a cache: the save goes on, sampling reads files
                        if fatal(e, self.engine.shard is not None):
                            raise
                        log.warning("no device copy of %s for sampling: %s", op.dir, e)
                if self.rank != 0:
                    if engine.shard is not None or engine.is_full(aid):  # gathered: all take part
                        engine.save(aid, op.dir, optimizer=op.optimizer, write=False)
                    return OutcomeF(i)
                digest = self.blobs.save(op.dir, lambda path: engine.save(
                    aid, path, optimizer=op.optimizer))  # uploaded, where the store is remote
                return OutcomeF(i, digest=digest)
            case LoadF():
                with self._readable(op.dir) as path:
                    info = engine.load(aid, path or op.dir, optimizer=op.optimizer,
                                       optimizer_type=op.optimizer_type, new_full=True)
                self.marks[aid] = op.mark
                self._persist(aid)
                return OutcomeF(i, info=info)
            case UnloadF():
                if engine.has_adapter(aid):
                    engine.remove_adapter(aid)
                self.parked.drop(aid)
                self.marks.pop(aid, None)
                if self.split is not None:
                    self.split.forget(aid)
                if self.persister is not None:
                    self.persister.forget(aid)
                return OutcomeF(i)
            case IdleUnloadF() if engine.is_full(aid):  # it holds the lane: stays live
                return OutcomeF(i)
            case IdleUnloadF():  # persisted first; a RestoreF brings it back
                if aid in self.parked and engine.shard is None:  # its snapshot, at its mark
                    return self._to_disk(i, aid)
                if aid in self.parked:  # a split adapter's slices: written whole from the
                    self.parked.unpark(aid)  # bank, as below (a collective, every rank)
                if engine.has_adapter(aid):
                    self._persist(aid, now=True)
                    if not self._flush():
                        return OutcomeF(i, error="persisting timed out", category="server")
                    engine.remove_adapter(aid)
                return OutcomeF(i)
            case ParkF():  # out of the bank into host memory, exactly (parked.py)
                self.parked.park(aid)
                return OutcomeF(i)
            case UnparkF():
                return OutcomeF(i, info=self.parked.unpark(aid, grow=self._grow))
            case PersistF():  # a hot restart: everything on disk before we answer
                if engine.has_adapter(aid):
                    self._persist(aid, now=True)
                if not self._flush():
                    return OutcomeF(i, error="persisting timed out", category="server")
                return OutcomeF(i)
        return OutcomeF(i, error=f"{type(op).__name__} cannot run in a barrier step",
                        category="server")

    def _to_disk(self, i: int, aid: str) -> OutcomeF:
        """A host-parked adapter's state written as its newest persisted version (rank 0;
        the other ranks just let go of theirs)."""
        snap = self.parked.take(aid)
        if self.persister is None:
            return OutcomeF(i)
        self.persister.hold(aid, snap, self.marks.get(aid, 0))
        if not self._flush():
            return OutcomeF(i, error="persisting timed out", category="server")
        return OutcomeF(i)

    def _restore(self, aid: str, op: RestoreF):
        """An adapter from its last persisted state, or fresh if it never got one; and the
        journal position that state holds (the daemon replays what came after)."""
        if self.engine.is_full(aid):  # never unloaded (IdleUnloadF above): as it is
            return self.engine.adapter_info(aid), self.marks.get(aid, 0)
        version = latest_version(Path(op.dir), aid) if op.dir else None
        with self._readable(version) as version:
            if self.engine.has_adapter(aid):
                self.engine.remove_adapter(aid)
            self.parked.drop(aid)  # what is restored replaces a parked copy
            if version is None:
                info, mark = self.engine.add_adapter(aid, op.config), 0
            else:
                mark = read_mark(version)
                info = self.engine.load(aid, version, optimizer=True)
        self.marks[aid] = mark
        return info, mark

    def _readable(self, path):
        """`path` as this rank can read it: rank 0's files when the group spans hosts."""
        return readable(self.blobs, path, self.rank, self.spans_hosts)
