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
from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch

from twinkled.engine import Engine, EngineInputError
from twinkled.engine.live import read_mark
from twinkled.engine.parallel import split_rows
from twinkled.engine.types import Datum, ForwardBackwardRequest, SampleRequest, SamplingParams
from twinkled.verify import checkpoint_digest

from .frames import (
    RETRY,
    Buf,
    CreateF,
    DatumF,
    FwdBwdOutF,
    IdleUnloadF,
    LoadF,
    OpF,
    OptimF,
    OutcomeF,
    PersistF,
    RestoreF,
    SampleF,
    SaveF,
    StepF,
    TrainF,
    UnloadF,
)
from .persist import Persister, latest_version
from .share import rank0_dir

log = logging.getLogger("twinkled.worker")

# Fault tests only: a pass holding a datum of this many tokens fails after its backward.
_FAIL_TOKENS = int(os.environ.get("TWINKLED_TEST_FAIL_TOKENS", "0"))
FRESH_SAMPLERS = 8  # device copies of just-saved sampler weights kept for their first use
SAMPLER_ADAPTERS = 32  # sampler checkpoints kept loaded; the least recently used goes first
_DTYPES = {"int64": torch.long, "float32": torch.float32}


def to_tensor(b: Buf) -> torch.Tensor:
    return torch.frombuffer(bytearray(b.data), dtype=_DTYPES[b.dtype]).reshape(b.shape)


def to_buf(t: torch.Tensor) -> Buf:
    t = t.detach().cpu().contiguous()
    t = t.float() if t.is_floating_point() else t.long()
    return Buf("float32" if t.dtype == torch.float32 else "int64", list(t.shape),
               t.numpy().tobytes())


def _datum(d: DatumF) -> Datum:
    return Datum(to_tensor(d.tokens), {k: to_tensor(v) for k, v in d.inputs.items()})


def fatal(e: BaseException, split: bool = False) -> bool:
    """A fault that leaves this rank unusable or out of step with the others (the group
    restarts). Anything else fails the requests it touched and the worker goes on. `split`
    (tensor parallelism): out of memory too, as the rank's peers wait in the collectives."""
    if isinstance(e, torch.OutOfMemoryError):
        return split
    kinds = tuple(k for k in (getattr(torch.distributed, "DistError", None),
                              getattr(torch, "AcceleratorError", None)) if k is not None)
    text = str(e)
    return (isinstance(e, kinds) or "CUDA error" in text or "NCCL" in text
            or "device-side assert" in text)


class StepRunner:
    def __init__(self, engine: Engine, rank: int, world: int, persister: Persister | None,
                 spans_hosts: bool = False, ep: int = 1, seed: int | None = None):
        self.engine = engine
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
        self.ep = ep
        self.seed = seed
        self.samples = 0
        self.persister = persister  # rank 0 only
        # Ranks on other hosts cannot read the daemon's data dir: what a load reads comes
        # from rank 0 (share.py), and every rank loads every sampler of a step, so that
        # this collective runs in the same order everywhere.
        self.spans_hosts = spans_hosts
        self.sampler_lru: OrderedDict[str, bool] = OrderedDict()
        # Sampler weights just saved (SaveF.sampler): checkpoint dir -> a device copy of the
        # adapter at that save. An RL loop saves and then samples at once; the first
        # sample then copies these on the device instead of reading the files back, and
        # every rank has them (the save ran everywhere), so no rank waits on a disk read
        # or, across hosts, on rank 0 sharing the files.
        self.fresh: OrderedDict[str, str] = OrderedDict()
        # Per adapter: the journal position of the last op after which it had no pending
        # gradients (what a snapshot of it holds; twinkled/journal.py).
        self.marks: dict[str, int] = {}

    def run(self, step: StepF) -> list[OutcomeF]:
        """Every op gets an outcome; an exception leaves only if the rank cannot go on."""
        if step.kind == "sample":
            return self._sample(step.ops)
        rows = [i for i, op in enumerate(step.ops) if isinstance(op, TrainF)]
        barriers = [i for i, op in enumerate(step.ops) if not isinstance(op, TrainF)]
        outcomes = self._train(step.ops, rows) if rows else []
        if any(o.category == RETRY for o in outcomes):
            # The pass failed: the step's barriers (optim_steps behind its rows) wait too.
            return sorted(outcomes + [OutcomeF(i, error="not run", category=RETRY)
                                      for i in barriers], key=lambda o: o.index)
        if barriers:
            outcomes += self._barriers(step.ops, barriers)
        return sorted(outcomes, key=lambda o: o.index)

    def persisted(self) -> dict[str, int]:
        """{adapter: journal mark} of the states written since the last reply."""
        return self.persister.take_written() if self.persister is not None else {}

    # -- forward/backward ---------------------------------------------------------------

    def _train(self, ops: list[OpF], indices: list[int]) -> list[OutcomeF]:
        outcomes, good = [], []
        for i in indices:
            f = ops[i]
            if f.adapter_id is not None and not self.engine.has_adapter(f.adapter_id):
                outcomes.append(OutcomeF(i, error=f"adapter_id: no adapter {f.adapter_id!r} "
                                         "is loaded", category="user"))
                continue
            good.append((i, ForwardBackwardRequest(f.adapter_id, [_datum(d) for d in f.data],
                                                   f.loss_fn, f.loss_config, f.forward_only)))
        rows = [(i, req, j) for i, req in good for j in range(len(req.data))]
        owner = split_rows([len(req.data[j].tokens) for _, req, j in rows], self.replicas)
        mine: dict[int, list[int]] = {i: [] for i, _ in good}
        for (i, _, j), r in zip(rows, owner, strict=True):
            if r == self.replica:
                mine[i].append(j)
        run = [(i, req) for i, req in good if mine[i]]
        try:  # checked at the door: the engine does not check again
            results = self.engine.forward_backward(
                [replace(req, data=[req.data[j] for j in mine[i]]) for i, req in run],
                checked=True)
            if _FAIL_TOKENS and any(len(req.data[j].tokens) == _FAIL_TOKENS
                                    for i, req in run for j in mine[i]):
                raise RuntimeError("injected failure (TWINKLED_TEST_FAIL_TOKENS)")
        except Exception as e:
            if fatal(e, self.engine.shard is not None):
                raise
            _release(e)
            why = f"{type(e).__name__}: {e}"
            return outcomes + [OutcomeF(i, error=why, category=RETRY) for i, _ in good]
        by_op = dict(zip([i for i, _ in run], results, strict=True))
        for i, _ in good:
            r = by_op.get(i) if self.reports else None
            rows_i = mine[i] if self.reports else []
            out = FwdBwdOutF(rows_i, [], {}) if r is None else FwdBwdOutF(
                mine[i], [{k: to_buf(v) for k, v in o.items()} for o in r.outputs], r.metrics)
            outcomes.append(OutcomeF(i, fwdbwd=out))
        return outcomes

    # -- sampling -----------------------------------------------------------------------

    def _sample(self, ops: list[OpF]) -> list[OutcomeF]:
        costs = [op.num_samples * (op.prompt.shape[0] + op.params.max_tokens) for op in ops]
        mine = [i for i, r in enumerate(split_rows(costs, self.replicas)) if r == self.replica]
        outcomes, good = [], []
        failed: dict[int, Exception] = {}
        if self.spans_hosts:  # every rank loads every sampler, in op order (collective)
            for i, s in enumerate(ops):
                try:
                    self._load_sampler(s)
                except Exception as e:
                    if fatal(e, self.engine.shard is not None):
                        raise
                    failed[i] = e
        for i in mine:
            s = ops[i]
            p = s.params
            seed = p.seed
            if seed is None and self.seed is not None:
                self.samples += 1
                seed = (self.seed + self.samples) % 2**62
            req = SampleRequest(
                s.adapter_id, to_tensor(s.prompt).tolist(),
                SamplingParams(p.max_tokens, p.temperature, p.top_k, p.top_p, seed, p.stop),
                s.num_samples, s.prompt_logprobs, s.prompt_last_n, s.topk_prompt, s.topk_sample,
                None if s.target_prompt is None else to_tensor(s.target_prompt).tolist(),
                s.alt_tokens_k)
            try:
                if i in failed:
                    raise failed[i]
                if not self.spans_hosts:
                    self._load_sampler(s)
                if s.adapter_id is not None and not self.engine.has_adapter(s.adapter_id):
                    raise EngineInputError("sampling_session_id", "its weights are not loaded")
                good.append((i, req))
            except Exception as e:
                if fatal(e, self.engine.shard is not None):
                    raise
                outcomes.append(OutcomeF(i, error=str(e), category=_category(e)))
        if good:
            outcomes += self._sample_batch(good)
        if not self.reports:  # the expert group's first rank answers for it
            outcomes = []
        # The same evictions on every rank when they must hold the same samplers.
        in_use = {ops[i].adapter_id for i in (range(len(ops)) if self.spans_hosts else mine)}
        while len(self.sampler_lru) > SAMPLER_ADAPTERS:
            old = next(iter(self.sampler_lru))
            if old in in_use:
                break
            self.sampler_lru.pop(old)
            self.engine.remove_adapter(old)
        return outcomes

    def _sample_batch(self, good: list[tuple[int, SampleRequest]]) -> list[OutcomeF]:
        """One batch; if it fails, each request alone, so only the one at fault fails
        (sampling changes no adapter)."""
        try:
            results = self.engine.sample([req for _, req in good], checked=True)
            return [OutcomeF(i, sample=r) for (i, _), r in zip(good, results, strict=True)]
        except Exception as e:
            if fatal(e, self.engine.shard is not None):
                raise
            _release(e)
            if len(good) == 1:
                return [OutcomeF(good[0][0], error=f"sampling failed: {type(e).__name__}: {e}",
                                 category="user")]
        return [o for item in good for o in self._sample_batch([item])]

    def _keep_fresh(self, adapter_id: str, directory: str) -> None:
        """A device copy of `adapter_id` as saved to `directory` (see `self.fresh`)."""
        name = f"fresh:{directory}"
        if self.fresh.pop(directory, None) is not None:
            self.engine.remove_adapter(name)  # saved again under the same name
        self.engine.copy_adapter(adapter_id, name)
        self.fresh[directory] = name
        while len(self.fresh) > FRESH_SAMPLERS:  # never sampled: the files will do
            _, old = self.fresh.popitem(last=False)
            self.engine.remove_adapter(old)

    def _load_sampler(self, op: SampleF) -> None:
        if not op.load_from:
            return
        if not self.engine.has_adapter(op.adapter_id):
            fresh = self.fresh.pop(op.load_from, None)
            if fresh is not None:
                self.engine.copy_adapter(fresh, op.adapter_id)
                self.engine.remove_adapter(fresh)
            elif self.spans_hosts:
                with rank0_dir(op.load_from, self.rank) as path:
                    self.engine.load(op.adapter_id, path or op.load_from, optimizer=False)
            else:
                self.engine.load(op.adapter_id, op.load_from, optimizer=False)
        self.sampler_lru[op.adapter_id] = True
        self.sampler_lru.move_to_end(op.adapter_id)

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

    def _persist(self, adapter_id: str, every: bool = False) -> None:
        if self.engine.shard is not None:
            # Split adapters are gathered whole now, on every rank of the group (a
            # collective, so not at the writer's leisure); rank 0 keeps the snapshot.
            snap = self.engine.snapshot(adapter_id)
            if self.persister is not None:
                self.persister.hold(adapter_id, snap, self.marks.get(adapter_id, 0), every)
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
        """Persist what changed, if the writer is free; True while something waits."""
        if self.persister is None:
            return False
        self.persister.pump(self.engine.pool.adapters, self.marks)
        return bool(self.persister.dirty)

    def _one(self, i: int, op: OpF) -> OutcomeF:
        """A barrier op, on every rank; its failure is its own (a save or load changed
        nothing)."""
        try:
            return self._barrier(i, op)
        except Exception as e:
            if fatal(e, self.engine.shard is not None):
                raise
            return OutcomeF(i, error=str(e) if isinstance(e, EngineInputError)
                            else f"{type(e).__name__}: {e}", category=_category(e))

    def _barrier(self, i: int, op: OpF) -> OutcomeF:
        engine, aid = self.engine, op.adapter_id
        match op:
            case CreateF(config=config):
                engine.add_adapter(aid, config)
                self.marks[aid] = op.mark
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
                        self._keep_fresh(aid, op.dir)
                    except Exception as e:  # a cache: the save goes on, sampling reads files
                        if fatal(e, self.engine.shard is not None):
                            raise
                        log.warning("no device copy of %s for sampling: %s", op.dir, e)
                if self.rank != 0:
                    if engine.shard is not None:  # gathered whole: every rank takes part
                        engine.save(aid, op.dir, optimizer=op.optimizer, write=False)
                    return OutcomeF(i)
                engine.save(aid, op.dir, optimizer=op.optimizer)
                return OutcomeF(i, digest=checkpoint_digest(Path(op.dir)))
            case LoadF():
                with self._readable(op.dir) as path:
                    info = engine.load(aid, path or op.dir, optimizer=op.optimizer,
                                       optimizer_type=op.optimizer_type)
                self.marks[aid] = op.mark
                self._persist(aid)
                return OutcomeF(i, info=info)
            case UnloadF():
                if engine.has_adapter(aid):
                    engine.remove_adapter(aid)
                self.marks.pop(aid, None)
                if self.persister is not None:
                    self.persister.forget(aid)
                return OutcomeF(i)
            case IdleUnloadF():  # persisted first; a RestoreF brings it back
                if engine.has_adapter(aid):
                    self._persist(aid)
                    if not self._flush():
                        return OutcomeF(i, error="persisting timed out", category="server")
                    engine.remove_adapter(aid)
                return OutcomeF(i)
            case PersistF():  # a hot restart: everything on disk before we answer
                if engine.has_adapter(aid):
                    self._persist(aid)
                if not self._flush():
                    return OutcomeF(i, error="persisting timed out", category="server")
                return OutcomeF(i)
        return OutcomeF(i, error=f"{type(op).__name__} cannot run in a barrier step",
                        category="server")

    def _restore(self, aid: str, op: RestoreF):
        """An adapter from its last persisted state, or fresh if it never got one; and the
        journal position that state holds (the daemon replays what came after)."""
        version = latest_version(Path(op.dir), aid) if op.dir else None
        with self._readable(version) as version:
            if self.engine.has_adapter(aid):
                self.engine.remove_adapter(aid)
            if version is None:
                info, mark = self.engine.add_adapter(aid, op.config), 0
            else:
                mark = read_mark(version)
                info = self.engine.load(aid, version, optimizer=True)
        self.marks[aid] = mark
        return info, mark

    def _readable(self, path):
        """`path` as this rank can read it: rank 0's files when the group spans hosts."""
        if self.spans_hosts:
            return rank0_dir(path, self.rank)
        return nullcontext(None if path is None else Path(path))


def _category(e: BaseException) -> str:
    return "user" if isinstance(e, EngineInputError) else "server"


def _release(e: BaseException) -> None:
    """After a failed pass: give back what it held, so the next step has the memory."""
    if isinstance(e, torch.OutOfMemoryError) and torch.cuda.is_available():
        torch.cuda.empty_cache()
