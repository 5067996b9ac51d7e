"""A rank's sampling steps: its share of a step's samples, the sampler weights they need
(loaded, copied from a fresh save, or shared by rank 0 across hosts), and which of those
stay loaded."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from twinkled.engine import Engine, EngineInputError
from twinkled.engine.parallel import split_rows
from twinkled.protocol.blobs import Blobs, unversioned
from twinkled.protocol.frames import OpF, OutcomeF, SampleF, SlicedF, StepF
from twinkled.protocol.types import SampleRequest, SamplingParams

from .gaps import GapChecks
from .parked import HostTier
from .patch_cache import PATCHES
from .rank_io import category, fatal, release, to_tensor
from .share import readable

FRESH_SAMPLERS = 8  # device copies of just-saved sampler weights kept for their first use
SAMPLER_ADAPTERS = 32  # sampler checkpoints kept loaded; the least recently used goes first
# ... to host memory (weights only, exact: workers/parked.py), up to this many bytes per
# worker; beyond, the longest parked go, and their checkpoint files bring them back.
SAMPLER_HOST_BYTES = 4 * 2**30
EARLY_RETURN_S = 0.02  # a finished sample ends its slice once this much of it has run


class SampleRunner:
    def __init__(self, engine: Engine, rank: int, replica: int, replicas: int, reports: bool,
                 spans_hosts: bool, seed: int | None, gap_every: int = 0,
                 blobs: Blobs | None = None):
        self.engine = engine
        self.blobs = blobs or Blobs.from_spec(None)  # where checkpoints live (protocol/blobs.py)
        self.gaps = GapChecks(engine, gap_every)  # sampler vs trainer logprobs (gaps.py)
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
        self.parked = HostTier(engine)  # samplers evicted from the bank, in host memory
        # Sampler weights just saved (SaveF.sampler): checkpoint dir -> a device copy of the
        # adapter at that save. An RL loop saves and then samples at once; the first
        # sample then copies these on the device instead of reading the files back, and
        # every rank has them (the save ran everywhere), so no rank waits on a disk read
        # or, across hosts, on rank 0 sharing the files.
        self.fresh: OrderedDict[str, str] = OrderedDict()
        # Sliced sampling: engine ticket -> (its sampler adapter, its SampleF.key, whether
        # its reader streams it), while it runs.
        self.queued: dict[int, tuple[str | None, str, bool]] = {}
        # Requests too large for the running batch while it is busy, with the same three:
        # they start, in order, once it is idle (it then grows to hold them).
        self.deferred: list[tuple[SampleRequest, tuple[str | None, str, bool]]] = []
        # Samplers in use besides the queued and deferred samples': the daemon's `hold`,
        # and while a step runs, its samples' (`give_room` leaves them be)
        self._hold: set[str] = set()
        # A bank at the daemon's budget: its samplers make room for what comes in
        engine.when_bank_full(self.give_room)

    def run(self, step: StepF, nudged: Callable[[], bool] | None = None) -> list[OutcomeF]:
        """This rank's share of the step's samples. Sliced (`step.slice_s` > 0, and an
        engine with a running batch): they join the running batch, it decodes for up to
        `slice_s` (`slice_max_s` if given, ending after `slice_s` once `nudged()`), and the
        outcomes are of the samples that finished, of this step or of earlier ones (`key`
        names them); the rest go on at the next "sample" or "slice" step (`news` says
        which). Else this step's samples run to completion."""
        ops = step.ops
        self._hold = {*step.hold, *(op.adapter_id for op in ops)}
        for key in step.cancel:
            self._cancel(key)
        good, outcomes = self._requests(ops)
        # (An expert or tensor-parallel group's ranks run one running batch in step, its
        # layers' collectives between them: slices cut by time would part them. Its samples
        # run to the end.)
        sliced = (step.slice_s > 0 and not self.engine.padded_sampling
                  and self.engine.experts is None and self.engine.shard is None)
        if sliced:
            if self.deferred and self.engine.sample_idle:
                deferred, self.deferred = self.deferred, []
                outcomes += self._submit([(-1, req, meta) for req, meta in deferred])
            outcomes += self._submit([(i, req, (ops[i].adapter_id, ops[i].key, ops[i].stream))
                                      for i, req in good])
            outcomes += self._slice(step.slice_s, step.slice_max_s, nudged)
        elif good:
            outcomes += self._batch(good)
        if not self.reports:  # the expert group's first rank answers for it
            outcomes = []
        for o in outcomes:
            if o.index >= 0:
                o.key = ops[o.index].key
        if self.spans_hosts:  # the same on every rank: what the daemon says, and the step's
            self._evict({*step.hold, *(op.adapter_id for op in ops)})
        else:
            self._evict({*step.hold, *(q[0] for q in self.queued.values()),
                         *(q[0] for _, q in self.deferred),
                         *(ops[i].adapter_id for i, _ in good)})
        self._hold = set(step.hold)  # (this step's own samples are done, or queued)
        return outcomes

    def news(self) -> SlicedF | None:
        """The samples this rank still decodes, and the streamed ones' new tokens."""
        if not self.reports:
            return None
        streamed = [t for t, q in self.queued.items() if q[2]]
        pieces = {self.queued[t][1]: seqs for t, seqs in self.engine.sample_partials(streamed).items()
                  if any(s.tokens for s in seqs)}
        running = [q[1] for q in self.queued.values()] + [q[1] for _, q in self.deferred]
        return SlicedF(running, self.engine.sample_waiting + len(self.deferred), pieces,
                       stocked=bool(self.deferred) or self.engine.sample_stocked)

    def _requests(self, ops: list[OpF]) -> tuple[list[tuple[int, SampleRequest]], list[OutcomeF]]:
        """This rank's share of `ops` as engine requests (their samplers loaded), and the
        outcomes of those that cannot run."""
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
        PATCHES.warm(f for i in mine for f in ops[i].images)
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
                req.images = tuple(PATCHES.get(f) for f in s.images)  # (its patches)
                if not self.spans_hosts:
                    self._load_sampler(s)
                if s.adapter_id is not None and not self.engine.has_adapter(s.adapter_id):
                    raise EngineInputError("sampling_session_id", "its weights are not loaded")
                good.append((i, req))
            except Exception as e:
                if fatal(e, self.split):
                    raise
                outcomes.append(OutcomeF(i, error=str(e), category=category(e)))
        return good, outcomes

    def _submit(self, items: list[tuple[int, SampleRequest, tuple[str | None, str, bool]]]
                ) -> list[OutcomeF]:
        """Queue (op index, request, (adapter, key, streamed?)) items in the running batch,
        one by one, so that one that cannot run fails alone. One too large for the batch
        while it is busy waits (`deferred`), and those behind it with it."""
        outcomes = []
        for i, req, meta in items:
            if self.deferred or not self.engine.sample_fits(req):
                self.deferred.append((req, meta))
                continue
            try:
                (ticket,) = self.engine.sample_submit([req], checked=True)
            except Exception as e:
                if fatal(e, self.split):
                    raise
                release(e)
                outcomes.append(OutcomeF(i, error=str(e) if isinstance(e, EngineInputError)
                                         else f"sampling failed: {type(e).__name__}: {e}",
                                         category=category(e), key=meta[1]))
                continue
            self.queued[ticket] = meta
            self.gaps.admitted(ticket, req)
        return outcomes

    def _slice(self, seconds: float, longest: float = 0.0,
               nudged: Callable[[], bool] | None = None) -> list[OutcomeF]:
        """Decode for up to `seconds` (`longest`, if longer, unless `nudged()` after
        `seconds`), or until a sample finished; the outcomes of the samples that finished.
        If the batch fails, every sample it held fails (which one was at fault is not
        known)."""
        stop = None
        if longest > seconds and nudged is not None:
            # Nothing else waited when the daemon sent this: each slice's end costs the
            # card a round trip to the daemon with nothing queued (8B, 8 tenants'
            # fan-out: 0.82x the engine alone in turns of 250 ms, 0.90x in turns of 1 s).
            # Work that arrives meanwhile still gets its turn when `seconds` would end.
            ends = time.monotonic() + seconds

            def stop() -> bool:
                return time.monotonic() >= ends and nudged()
            seconds = longest
        try:
            # Back soon after a sample finished: its client hears within EARLY_RETURN_S,
            # and the daemon goes on with the others (and new ones) if sampling's turn is
            # not over. Not at once: a rollout whose samples end one by one would pay a
            # round trip to the daemon per sample (measured on a CPU: 10-20% slower).
            finished = self.engine.sample_slice(max_seconds=seconds, until_done=True,
                                                min_seconds=min(seconds, EARLY_RETURN_S),
                                                stop=stop)
        except Exception as e:
            if fatal(e, self.split):
                raise
            release(e)
            why = f"sampling failed beside other samples: {type(e).__name__}: {e}"
            out = [OutcomeF(-1, error=why, category="server", key=q[1])
                   for q in self.queued.values()]
            for ticket in self.queued:
                self.gaps.finished(ticket, None)
            self.queued.clear()
            return out
        out = []
        for f in finished:
            self.gaps.finished(f.ticket, f.result.sequences)
            queued = self.queued.pop(f.ticket, None)
            if queued is not None:  # (None: cancelled after it finished)
                out.append(OutcomeF(-1, sample=f.result, key=queued[1]))
        return out

    def _cancel(self, key: str) -> None:
        for ticket, q in list(self.queued.items()):
            if q[1] == key:
                self.engine.sample_cancel(ticket)
                self.gaps.finished(ticket, None)
                del self.queued[ticket]
        self.deferred = [d for d in self.deferred if d[1][1] != key]

    def _evict(self, in_use: set[str | None]) -> None:
        """Keep at most SAMPLER_ADAPTERS samplers loaded, never one in use (ranks that
        span hosts must evict alike, so they are told what is in use)."""
        while len(self.sampler_lru) > SAMPLER_ADAPTERS:
            old = next(iter(self.sampler_lru))
            if old in in_use:
                break
            self.sampler_lru.pop(old)
            self._park(old)

    def give_room(self, bank) -> None:
        """An adapter (a training run's, or a sampler) needs a slot of `bank`, which holds
        what the daemon's budget does (`LoraPool.at_budget`): the budget counts training
        adapters, and samplers take what is left. So the bank's fresh sampler copies leave
        it (their files will do), then its least recently used samplers no sample uses (to
        host memory), until a slot is free; else the bank grows past the budget, one slot
        at a time (a big bank's growth copies it whole, and may find no room). Not where
        every rank must evict alike (tensor-parallel, or over hosts): those samplers stay."""
        if self.split or self.spans_hosts:
            return
        pool = self.engine.pool
        for directory, name in list(self.fresh.items()):
            if bank.free:
                return
            if pool.bank_of(name) is bank:
                del self.fresh[directory]
                self.engine.remove_adapter(name)
        busy = {*self._hold, *(q[0] for q in self.queued.values()),
                *(q[0] for _, q in self.deferred)}
        for aid in list(self.sampler_lru):
            if bank.free:
                return
            if aid not in busy and self.engine.has_adapter(aid) and pool.bank_of(aid) is bank:
                self.sampler_lru.pop(aid)
                self._park(aid)

    def _park(self, adapter_id: str) -> None:
        """An evicted sampler to host memory (its files stay the disk tier)."""
        if self.engine.is_full(adapter_id) or not self.engine.has_adapter(adapter_id):
            self.engine.remove_adapter(adapter_id)  # a view of a full run's weights: dropped
            return
        if self.split or self.spans_hosts:  # every rank must evict alike: the files do
            self.engine.remove_adapter(adapter_id)
            return
        self.parked.park(adapter_id, training=False)
        while self.parked.bytes() > SAMPLER_HOST_BYTES:
            self.parked.drop(self.parked.oldest())

    def _batch(self, good: list[tuple[int, SampleRequest]]) -> list[OutcomeF]:
        """One batch; if it fails, each request alone, so only the one at fault fails
        (sampling changes no adapter)."""
        try:
            results = self.engine.sample([req for _, req in good], checked=True)
            for (_, req), r in zip(good, results, strict=True):
                self.gaps.sampled(req, r.sequences)
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
        if op.adapter_id in self.parked:  # keyed by content: the same weights
            self.parked.unpark(op.adapter_id)
        elif not self.engine.has_adapter(op.adapter_id):
            # keyed by the save's locator; a version in an object store is under it
            fresh = self.fresh.pop(unversioned(op.load_from), None)
            if fresh is not None:
                self.engine.copy_adapter(fresh, op.adapter_id)
                self.engine.remove_adapter(fresh)
            else:
                with readable(self.blobs, op.load_from, self.rank, self.spans_hosts) as path:
                    self.engine.load(op.adapter_id, path or op.load_from, optimizer=False)
        self.sampler_lru[op.adapter_id] = True
        self.sampler_lru.move_to_end(op.adapter_id)
