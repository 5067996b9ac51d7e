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

from collections import OrderedDict
from dataclasses import replace
from pathlib import Path

import torch

from twinkled.engine import Engine, EngineInputError
from twinkled.engine.parallel import split_rows
from twinkled.engine.types import Datum, ForwardBackwardRequest, SampleRequest, SamplingParams
from twinkled.verify import checkpoint_digest

from .frames import Buf, DatumF, FwdBwdOutF, OpF, OutcomeF, StepF
from .persist import Persister, latest_version

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


class StepRunner:
    def __init__(self, engine: Engine, rank: int, world: int, persister: Persister | None):
        self.engine = engine
        self.rank, self.world = rank, world
        self.persister = persister  # rank 0 only
        self.sampler_lru: OrderedDict[str, bool] = OrderedDict()

    def run(self, step: StepF) -> list[OutcomeF]:
        if step.kind == "sample":
            return self._sample(step.ops)
        rows = [i for i, op in enumerate(step.ops) if op.kind == "fwdbwd"]
        barriers = [i for i, op in enumerate(step.ops) if op.kind != "fwdbwd"]
        outcomes = self._train(step.ops, rows) if rows else []
        if barriers:
            outcomes += self._barriers(step.ops, barriers)
        return sorted(outcomes, key=lambda o: o.index)

    # -- forward/backward ---------------------------------------------------------------

    def _train(self, ops: list[OpF], indices: list[int]) -> list[OutcomeF]:
        outcomes, good = [], []
        for i in indices:
            f = ops[i].fwdbwd
            req = ForwardBackwardRequest(f.adapter_id, [_datum(d) for d in f.data], f.loss_fn,
                                         f.loss_config, f.forward_only)
            try:
                self.engine.check(req)
                good.append((i, req, range(f.lo, len(req.data) if f.hi is None else f.hi)))
            except EngineInputError as e:
                outcomes.append(OutcomeF(i, error=str(e), category="user"))
        rows = [(i, req, j) for i, req, span in good for j in span]
        owner = split_rows([len(req.data[j].tokens) for _, req, j in rows], self.world)
        mine: dict[int, list[int]] = {i: [] for i, _, _ in good}
        for (i, _, j), r in zip(rows, owner, strict=True):
            if r == self.rank:
                mine[i].append(j)
        run = [(i, req) for i, req, _ in good if mine[i]]
        results = self.engine.forward_backward(
            [replace(req, data=[req.data[j] for j in mine[i]]) for i, req in run])
        by_op = dict(zip([i for i, _ in run], results, strict=True))
        for i, _, _ in good:
            r = by_op.get(i)
            out = FwdBwdOutF(mine[i], [], {}) if r is None else FwdBwdOutF(
                mine[i], [{k: to_buf(v) for k, v in o.items()} for o in r.outputs], r.metrics)
            outcomes.append(OutcomeF(i, fwdbwd=out))
        return outcomes

    # -- sampling -----------------------------------------------------------------------

    def _sample(self, ops: list[OpF]) -> list[OutcomeF]:
        costs = [op.sample.num_samples * (len(op.sample.prompt.data) // 8 + op.sample.params.max_tokens)
                 for op in ops]
        mine = [i for i, r in enumerate(split_rows(costs, self.world)) if r == self.rank]
        outcomes, good = [], []
        for i in mine:
            s = ops[i].sample
            p = s.params
            req = SampleRequest(s.adapter_id, to_tensor(s.prompt).tolist(), SamplingParams(
                p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed, p.stop),
                s.num_samples, s.prompt_logprobs)
            try:
                self._load_sampler(ops[i])
                self.engine.check(req)
                good.append((i, req))
            except EngineInputError as e:
                outcomes.append(OutcomeF(i, error=str(e), category="user"))
        if good:
            results = self.engine.sample([req for _, req in good])
            outcomes += [OutcomeF(i, sample=r) for (i, _), r in zip(good, results, strict=True)]
        in_use = {ops[i].adapter_id for i in mine}
        while len(self.sampler_lru) > SAMPLER_ADAPTERS:
            old = next(iter(self.sampler_lru))
            if old in in_use:
                break
            self.sampler_lru.pop(old)
            self.engine.remove_adapter(old)
        return outcomes

    def _load_sampler(self, op: OpF) -> None:
        if not op.load_from:
            return
        if not self.engine.has_adapter(op.adapter_id):
            self.engine.load(op.adapter_id, op.load_from, optimizer=False)
        self.sampler_lru[op.adapter_id] = True
        self.sampler_lru.move_to_end(op.adapter_id)

    # -- barriers -----------------------------------------------------------------------

    def _barriers(self, ops: list[OpF], indices: list[int]) -> list[OutcomeF]:
        optims = [i for i in indices if ops[i].kind == "optim"]
        outcomes = [self._one(i, ops[i]) for i in indices if ops[i].kind != "optim"]
        if not optims:
            return outcomes
        try:  # several models' optimizer steps as one engine call
            results = self.engine.optim_steps([(ops[i].adapter_id, ops[i].params) for i in optims])
            stepped = [OutcomeF(i, optim=r) for i, r in zip(optims, results, strict=True)]
        except EngineInputError:  # one bad step: run them one by one to blame the right one
            stepped = [self._one(i, ops[i]) for i in optims]
        for o in stepped:
            if o.optim is not None and o.optim.applied:
                self._persist(ops[o.index].adapter_id, every=True)
        return outcomes + stepped

    def _persist(self, adapter_id: str, every: bool = False) -> None:
        if self.persister is None:
            return
        if every:
            self.persister.after_step(adapter_id, self.engine.pool.get(adapter_id))
        else:
            self.persister.mark(adapter_id)

    def between_steps(self) -> bool:
        """Persist what changed, if the writer is free; True while something waits."""
        if self.persister is None:
            return False
        self.persister.pump(self.engine.pool.adapters)
        return bool(self.persister.dirty)

    def _one(self, i: int, op: OpF) -> OutcomeF:
        engine, aid = self.engine, op.adapter_id
        try:
            if op.kind == "create":
                engine.add_adapter(aid, op.config)
                self._persist(aid)
                return OutcomeF(i, info=engine.adapter_info(aid))
            if op.kind == "restore":
                return OutcomeF(i, info=self._restore(aid, op))
            if op.kind == "optim":
                result = engine.optim_step(aid, op.params)
                if result.applied:
                    self._persist(aid, every=True)
                return OutcomeF(i, optim=result)
            if op.kind == "save":
                if self.rank != 0:
                    return OutcomeF(i)
                engine.save(aid, op.dir, optimizer=op.optimizer)
                return OutcomeF(i, digest=checkpoint_digest(Path(op.dir)))
            if op.kind == "load":
                info = engine.load(aid, op.dir, optimizer=op.optimizer)
                self._persist(aid)
                return OutcomeF(i, info=info)
            if op.kind == "unload":
                if engine.has_adapter(aid):
                    engine.remove_adapter(aid)
                if self.persister is not None:
                    self.persister.forget(aid)
                return OutcomeF(i)
            if op.kind == "idle_unload":  # persisted first; `restore` brings it back
                if engine.has_adapter(aid):
                    self._persist(aid)
                    if self.persister is not None and not self.persister.flush(
                            engine.pool.adapters):
                        return OutcomeF(i, error="persisting timed out", category="server")
                    engine.remove_adapter(aid)
                return OutcomeF(i)
            if op.kind == "persist":  # a hot restart: everything on disk before we answer
                if engine.has_adapter(aid):
                    self._persist(aid)
                if self.persister is not None and not self.persister.flush(engine.pool.adapters):
                    return OutcomeF(i, error="persisting timed out", category="server")
                return OutcomeF(i)
            return OutcomeF(i, error=f"unknown operation {op.kind!r}", category="server")
        except EngineInputError as e:
            return OutcomeF(i, error=str(e), category="user")

    def _restore(self, aid: str, op: OpF):
        """An adapter from its last persisted state, or fresh if it never got one."""
        version = latest_version(Path(op.dir), aid) if op.dir else None
        if self.engine.has_adapter(aid):
            self.engine.remove_adapter(aid)
        if version is None:
            return self.engine.add_adapter(aid, op.config)
        return self.engine.load(aid, version, optimizer=True)
