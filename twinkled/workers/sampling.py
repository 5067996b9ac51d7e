"""A rank's sampling steps: its share of a step's samples, the sampler weights they need
(loaded, copied from a fresh save, or shared by rank 0 across hosts), and which of those
stay loaded."""

from __future__ import annotations

from collections import OrderedDict

from twinkled.engine import Engine, EngineInputError
from twinkled.engine.parallel import split_rows
from twinkled.engine.types import SampleRequest, SamplingParams

from .frames import OpF, OutcomeF, SampleF
from .rank_io import category, fatal, release, to_tensor
from .share import rank0_dir

FRESH_SAMPLERS = 8  # device copies of just-saved sampler weights kept for their first use
SAMPLER_ADAPTERS = 32  # sampler checkpoints kept loaded; the least recently used goes first


class SampleRunner:
    def __init__(self, engine: Engine, rank: int, replica: int, replicas: int, reports: bool,
                 spans_hosts: bool, seed: int | None):
        self.engine = engine
        self.rank = rank
        # Samples are split over the data-parallel replicas; one rank of each reports.
        self.replica, self.replicas, self.reports = replica, replicas, reports
        self.split = engine.shard is not None  # a tensor-parallel rank (rank_io.fatal)
        # Unseeded samples get seeds from `seed` (the same on every rank), so an expert
        # group's ranks draw the same tokens.
        self.seed = seed
        self.samples = 0
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

    def run(self, ops: list[OpF]) -> list[OutcomeF]:
        """Every op gets an outcome (this rank's share of them, if it reports)."""
        costs = [op.num_samples * (op.prompt.shape[0] + op.params.max_tokens) for op in ops]
        mine = [i for i, r in enumerate(split_rows(costs, self.replicas)) if r == self.replica]
        outcomes, good = [], []
        failed: dict[int, Exception] = {}
        if self.spans_hosts:  # every rank loads every sampler, in op order (collective)
            for i, s in enumerate(ops):
                try:
                    self._load_sampler(s)
                except Exception as e:
                    if fatal(e, self.split):
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
                if fatal(e, self.split):
                    raise
                outcomes.append(OutcomeF(i, error=str(e), category=category(e)))
        if good:
            outcomes += self._batch(good)
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

    def _batch(self, good: list[tuple[int, SampleRequest]]) -> list[OutcomeF]:
        """One batch; if it fails, each request alone, so only the one at fault fails
        (sampling changes no adapter)."""
        try:
            results = self.engine.sample([req for _, req in good], checked=True)
            return [OutcomeF(i, sample=r) for (i, _), r in zip(good, results, strict=True)]
        except Exception as e:
            if fatal(e, self.split):
                raise
            release(e)
            if len(good) == 1:
                return [OutcomeF(good[0][0], error=f"sampling failed: {type(e).__name__}: {e}",
                                 category="user")]
        return [o for item in good for o in self._batch([item])]

    def keep_fresh(self, adapter_id: str, directory: str) -> None:
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
