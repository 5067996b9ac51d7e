"""The service: what the daemon does, as commands, independent of the wire protocol.

The Tinker routes (tinker_shim/) decode a request, call one command here, and encode its
answer. A command checks what can be known at once, records what the store must keep, and
queues an op on the engine core (core.py), returning the future the client polls. The
daemon's life cycle (start, drain, shutdown, what healthz and status report) is a composed
object, `service.life` (lifecycle.py), which every command asks whether the daemon takes
work now. Nothing here imports torch.

Read top to bottom, it is the daemon's list of commands (a short method each), with the
intake checks they share (`submit`, `_admit`, `_created`: a refusal records nothing).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import astuple, replace
from typing import Any

from twinkled.core import otel
from twinkled.core.engine_core import RateLimited  # noqa: F401  (re-exported)
from twinkled.core.exclusive import full_run_lane
from twinkled.core.executor import Executor
from twinkled.core.futures import Encoder, Future, Futures, empty_json
from twinkled.core.lanes import Lane
from twinkled.core.lifecycle import Draining, LifeCycle  # noqa: F401  (Draining re-exported)
from twinkled.core.make_lanes import make_lanes
from twinkled.core.metrics import Metrics
from twinkled.core.ops import After, Op
from twinkled.core.recent_samples import RecentSamples
from twinkled.core.residency import stored_config
from twinkled.core.stability import StabilityRecords
from twinkled.core.streams import SampleStream
from twinkled.core.tenants import Tenants
from twinkled.protocol.blobs import Blobs, versioned
from twinkled.protocol.checkpoints import checkpoint_path
from twinkled.protocol.checks import Limits as RequestLimits
from twinkled.protocol.config import Config
from twinkled.protocol.errors import Conflict, NotFound, UserError  # noqa: F401
from twinkled.protocol.frames import CreateF, LoadF, OptimF, SampleF, SaveF, TrainF, UnloadF
from twinkled.protocol.prefixes import datum_costs
from twinkled.protocol.types import LoraConfig
from twinkled.store.checkpoints import Version
from twinkled.store.runs import Runs

# How a command that makes something answers, given the id of what it made (a model, a
# checkpoint path, a sampler): the protocol layer's choice, like an Encoder.
Answer = Callable[[str], tuple[bytes, str]]


def _same_lora(stored: dict | None, asked: dict) -> bool:
    """A retried create asks for the run's config (its seed may be drawn anew each time)."""
    def plain(c: dict | None) -> dict:
        return {k: v for k, v in (c or {}).items() if k != "seed"}
    return plain(stored) == plain(asked)


class Service:
    def __init__(self, config: Config, store, executor: Executor | list[Executor] | None = None,
                 adapter_budget: int | None = None, full_run_room: int | None = None):
        """`executor`: where steps run, one per lane (`config.lanes`); by default a worker
        group over ZeroMQ per lane (tests pass in-process ones, `workers/inprocess.py`).
        `adapter_budget`: bytes per rank for adapters (`layout.adapters_budget`; None: no
        limit), unless the config sets one. `full_run_room`: bytes per rank a full-parameter
        run's state has on its lane (`layout.full_run_room`; None: no limit)."""
        self.config = config
        self.store = store
        self.blobs = Blobs.from_config(config)  # where checkpoint files live (protocol/blobs.py)
        # What samplers produced, for stable_reinforce (filled by `sample`, read by the
        # forward_backward that names it).
        self.stability = StabilityRecords(config.stability_bytes, config.stability_tenant_bytes)
        self.recent_samples = RecentSamples()  # the console's last sampling calls of a run
        self.metrics = Metrics(self)
        self.futures = Futures(store)
        # One lane per executor (by default a worker group per `config.lanes`; make_lanes.py)
        self.lanes = make_lanes(config, store, self.futures, self.metrics, executor,
                                adapter_budget, full_run_room)
        self.tenants = Tenants(config, store, self.lanes.planners)
        self._limits: RequestLimits | None = None
        self._limits_from: dict | None = None
        # loading/ready/failed/draining, start and stop, what healthz says (lifecycle.py)
        self.life = LifeCycle(config, store, self.blobs, self.lanes, self.futures,
                              self.refresh_tenants)

    @property
    def model_info(self) -> dict:
        return self.lanes.model_info()

    @property
    def limits(self) -> RequestLimits:
        """What one request may ask (`engine/checks.py`), checked at the door: the config's
        limits and the model's numbers (the workers' once loaded, config.json's until then)."""
        info = self.model_info or self.config.model_config
        if self._limits is None or self._limits_from is not info:
            self._limits, self._limits_from = self.config.request_limits(info), info
        return self._limits

    # -- commands ---------------------------------------------------------------------

    def submit(self, op: Op, lane: Lane | None = None) -> Future:
        """Queue `op` on its lane's core (see EngineCore.add), if the daemon takes work now.
        `lane`: where a sample goes (`Lanes.for_sample`); a model's ops go to its lane."""
        try:
            self.life.check_intake()
            self.life.check_loaded(op.model_id)
        except (UserError, Draining) as e:
            self.futures.drop(op.future, str(e))
            raise
        if otel.enabled():  # the request's spans of this op (core/otel.py)
            otel.submitted(op)
        return (lane or self.lanes.of(op.model_id)).core.add(op)

    def _admit(self, tenant: str, model: str, seq_id: int, kind: str) -> Future | None:
        """Before a command records anything for op `seq_id` of `model`: the original
        future if the client retries a request already taken (nothing is done again), None
        if the op would be queued; raises what the op would be refused with."""
        self.life.check_intake()
        self.life.check_loaded(model)
        return self.lanes.of(model).core.admit(tenant, model, seq_id, kind)

    def _created(self, tenant: str, session_id: str, model_seq: int | None,
                 lora: dict) -> tuple[str, Future] | None:
        """Before a create records its run: the run and original future of a create the
        client retries (it lost the answer): run `model_seq` of the session, this tenant's,
        made with the same config, whose create is still known. None otherwise (a new
        model, or a different request for a taken id: refused). Raises if the daemon takes
        no work now (a 503's retry must find no run)."""
        self.life.check_intake()
        if model_seq is None:  # the store numbers it: a new model
            return None
        model = Runs.id_of(session_id, model_seq)
        run = self.store.runs.get(model, include_deleted=True)
        if run is None or run["tenant"] != tenant or not _same_lora(run["lora_config"], lora):
            return None
        original = self.lanes.of(model).core.original(tenant, model, 0, "create_model")
        return None if original is None else (model, original)

    def refuse(self, tenant: str, model_id: str, seq_id: int | None, why: str) -> None:
        self.lanes.of(model_id).core.refuse(tenant, model_id, seq_id, why)

    def get_future(self, tenant: str, future_id: str) -> Future:
        return self.futures.get(tenant, future_id)

    def is_paused(self, future_id: str) -> bool:
        return self.lanes.find(lambda lane: lane.planner.is_paused(future_id))

    async def ensure_loaded(self, run: dict) -> None:
        """Bring back a run's adapter if it was unloaded while idle (not while the daemon
        takes no work: its request would be refused after the reload)."""
        if not self.lanes.of(run["id"]).residency.is_open(run["id"]):
            self.life.check_intake()
            # Starting: the runs live at the last stop are being restored, and one reloaded
            # here meanwhile would be restored again over its queued requests (they hung).
            self.life.check_loaded(run["id"])
        await self.lanes.ensure_loaded(run)

    def create_model(self, tenant: str, session_id: str, model_seq: int | None,
                     config: LoraConfig, user_metadata: dict,
                     answer: Answer) -> tuple[str, Future]:
        """A new training run and its adapter (op 0 of the model): its id and future. A
        retried create (same model_seq, same config) answers the original future."""
        if config.seed is None:
            # Drawn here rather than by the worker: the initial weights then follow from
            # the run's stored config, so a restore before its first persisted state makes
            # them again and a create writes nothing (1,000 creates of the 0.5B wrote 211 GB)
            config = replace(config, seed=secrets.randbelow(2**31))
        lora = {"rank": config.rank, "alpha": config.alpha, "train_attn": config.train_attn,
                "train_mlp": config.train_mlp, "train_unembed": config.train_unembed,
                "seed": config.seed, "optimizer": config.optimizer}  # a restore re-creates it
        if (retried := self._created(tenant, session_id, model_seq, lora)) is not None:
            return retried
        if config.rank and not (config.train_attn or config.train_mlp or config.train_unembed):
            # (here, not only in the engine: a run the bank has no room for starts parked,
            # and would hear it only at its first request)
            raise UserError("lora_config: train_attn, train_mlp and train_unembed are all "
                            "false; at least one must be true")
        self.tenants.check_new_adapter(tenant, config.rank)
        if config.rank == 0:  # full-parameter: a lane of its own (core/exclusive.py)
            lane = full_run_lane(self.lanes, self.tenants, self.config, tenant)
        else:
            lane = self.lanes.choose(config)
        lane.residency.check(config, tenant)
        try:
            model = self.store.runs.create(session_id, tenant, self.config.served_name,
                                           config.rank, lora, user_metadata, model_seq)
        except Conflict:
            raise UserError(f"model {session_id}:train:{model_seq} already exists") from None
        if config.rank == 0:
            self.lanes.exclusive.hold(lane, model, tenant)
        f = self.futures.new(tenant, "create_model", lambda _: answer(model))
        return model, self._open(lane, tenant, config, Op(model, 0, CreateF(model, config), f))

    def tag_future(self, future_id: str, owner: str) -> None:
        """Record the run or sampler a request's future belongs to (a session's trace)."""
        self.futures.tag(future_id, owner)

    def forward_backward(self, tenant: str, model: str, seq_id: int, frame: TrainF,
                         encode: Encoder) -> Future:
        # Where the planner may cut it, and what each datum costs a step (a shared prefix
        # is computed once: protocol/prefixes.py)
        parts = datum_costs(frame, self.config.shared_prefix if self.config.packing else 0)
        # A forward is a future of its own kind: a failed one loses no gradients, and a
        # restart tells them apart (store/futures.py, failed_training).
        kind = "forward" if frame.forward_only else "forward_backward"
        f = self.futures.new(tenant, kind, encode, run=model)
        tokens = sum(d.tokens.shape[0] for d in frame.data)
        self.lanes.long.saw(model, tenant, max((d.tokens.shape[0] for d in frame.data), default=0))
        f = self.submit(Op(model, seq_id, frame, f, sum(parts), parts=parts,
                           after=self.store.steps.recorder(model, seq_id, kind, tokens)))
        self.store.runs.touch(model)
        return f

    def optim_step(self, tenant: str, model: str, seq_id: int, frame: OptimF,
                   encode: Encoder) -> Future:
        f = self.futures.new(tenant, "optim_step", encode)
        return self.submit(Op(model, seq_id, frame, f,
                              after=self.store.steps.recorder(model, seq_id, "optim_step")))

    def save(self, tenant: str, run: dict, seq_id: int, kind: str, name: str, *,
             optimizer: bool, user_metadata: dict, ttl_s: float | None, overwrite: bool,
             answer: Answer) -> Future:
        """Save checkpoint `tinker://<run>/<kind>/<name>` in the run's order; the store
        learns its size and digest (or why it failed).

        A retried seq_id is the original request: its future, and nothing recorded again.
        A new name is recorded as being written at once; a new version of a ready one
        replaces it only once written (the old one is served until then, and stays if the
        save fails or never runs)."""
        if (original := self._admit(tenant, run["id"], seq_id, "save")) is not None:
            return original
        path = checkpoint_path(run["id"], kind, name)
        directory = self.blobs.base(run["id"], kind, name)
        quota = self.store.checkpoints.storage_quota(tenant,
                                                     self.config.storage_quota_default(tenant))
        version = Version(run["id"], tenant, kind, name, str(directory), user_metadata or None,
                          expires_at=time.time() + ttl_s if ttl_s else None)
        try:
            self.store.checkpoints.begin(*astuple(version), overwrite=overwrite,
                                         quota_bytes=quota)
        except Conflict as e:
            raise UserError(str(e)) from None

        def after(result: Any, message: str | None) -> None:
            if message is None:  # the files are where readers find them (Blobs.save)
                old = self.store.checkpoints.get(path)
                done = replace(version, dir=versioned(version.dir, result[1]))
                self.store.checkpoints.finish(path, *result, version=done)
                if old is not None and old["status"] == "ready" and old["dir"] != done.dir:
                    self.blobs.delete_later(old["dir"])  # the version this one replaced
            else:
                self.store.checkpoints.abandon(path, message)

        f = self.futures.new(tenant, "save", lambda _: answer(path))
        # Sampler weights are sampled next: the workers keep a device copy for that.
        frame = SaveF(run["id"], str(directory), optimizer, sampler=kind == "sampler_weights")
        return self.submit(Op(run["id"], seq_id, frame, f, after=after))

    def save_for_sampler(self, tenant: str, run: dict, seq_id: int, sampler_seq: int | None,
                         *, user_metadata: dict, ttl_s: float | None,
                         answer: Answer) -> Future:
        """A snapshot of the adapter (kept an hour unless `ttl_s` says otherwise) and a
        sampling session on it."""
        if (original := self._admit(tenant, run["id"], seq_id, "save")) is not None:
            return original  # a retry: its sampler is the one the original made
        path = checkpoint_path(run["id"], "sampler_weights", f"ephemeral-{seq_id}")
        try:
            sampler = self.store.samplers.create(run["session_id"], tenant,
                                                 self.config.served_name, path, sampler_seq)
        except Conflict:
            raise UserError("that sampling_session_seq_id is already used") from None
        return self.save(tenant, run, seq_id, "sampler_weights", f"ephemeral-{seq_id}",
                         optimizer=False, user_metadata=user_metadata,
                         ttl_s=3600 if ttl_s is None else ttl_s, overwrite=True,
                         answer=lambda _: answer(sampler))

    def load(self, tenant: str, run: dict, seq_id: int, checkpoint: dict, optimizer: bool,
             answer: Answer) -> Future:
        """A checkpoint's weights (and optimizer state) into an existing model."""
        if (original := self._admit(tenant, run["id"], seq_id, "load_weights")) is not None:
            return original
        f = self.futures.new(tenant, "load_weights", lambda _: answer(run["id"]))
        frame = LoadF(run["id"], checkpoint["dir"], optimizer, None)
        return self.submit(Op(run["id"], seq_id, frame, f))

    def create_from_checkpoint(self, tenant: str, session_id: str, model_seq: int | None,
                               checkpoint: dict, optimizer: bool, family: str,
                               user_metadata: dict, answer: Answer) -> tuple[str, Future]:
        """A new training run whose adapter is loaded from a checkpoint (op 0)."""
        src = self.store.runs.get(checkpoint["run_id"], include_deleted=True)
        lora = {**(src["lora_config"] or {}), "optimizer": family}
        if (retried := self._created(tenant, session_id, model_seq, lora)) is not None:
            return retried
        stored = stored_config({"lora_config": lora})
        if stored.rank == 0:  # a full run's state: a new full run, on a lane of its own
            lane = full_run_lane(self.lanes, self.tenants, self.config, tenant)
        else:
            lane = self.lanes.choose(stored)
        lane.residency.check(stored, tenant)
        try:
            model = self.store.runs.create(session_id, tenant, self.config.served_name,
                                           src["lora_rank"], lora, user_metadata, model_seq)
        except Conflict:
            raise UserError("that model_seq_id is already used in this session") from None
        if stored.rank == 0:
            self.lanes.exclusive.hold(lane, model, tenant)
        f = self.futures.new(tenant, "load_weights", lambda _: answer(model))
        return model, self._open(lane, tenant, stored,
                                 Op(model, 0, LoadF(model, checkpoint["dir"], optimizer,
                                                    family), f))

    def _open(self, lane: Lane, tenant: str, config: LoraConfig, op: Op) -> Future:
        """A new model on `lane`, its create or load (`op`, op 0) queued once its adapter
        has room in the GPU bank. With room now (or a full-parameter run, on a lane of its
        own), at once; else a create starts parked (Residency.start_parked) and a load's
        op 0 waits, queued nowhere, while the least recently used idle adapters are parked
        (Residency.make_room), and its client polls meanwhile. Holding
        the room first and parking behind let a burst of creates grow the workers' bank
        past its budget: 1,000 runs created by 64 clients ran an H200 out of memory
        (BENCHMARKS.md, session 20)."""
        model = op.model_id
        self.lanes.place(model, lane)
        residency = lane.residency
        if config.rank == 0 or residency.has_room(config):
            residency.room.hold(model, config)
            residency.open(model, tenant, 0)
            return self.submit(op)
        self.life.check_intake()  # (refused now, not after the wait)
        if isinstance(op.frame, CreateF):
            # A new run has nothing to copy in (its weights follow from its seed): it starts
            # parked on disk, answered at once, and its first request brings it in as any
            # parked run's, charged to its tenant. No one is parked for a run that may not
            # train for hours; 1,000 creates waited ~4 a second for parks on an H200.
            residency.start_parked(model)
            self.futures.bind(op.future, model, 0)  # (a retry of the create gets this one)
            self.futures.resolve(op.future, None)
            return op.future
        residency.open(model, tenant, 0)
        residency.when_room(model, config, tenant,
                            lambda why: self._submit_waited(lane, op, why))
        return op.future

    def _submit_waited(self, lane: Lane, op: Op, why: Exception | None) -> None:
        """Op 0 of a new model that waited for room: queued, or its future failed with why
        (no room could be made, or the daemon stopped taking work meanwhile)."""
        try:
            if why is not None:
                raise why
            self.submit(op)
        except Exception as e:
            lane.residency.room.release(op.model_id)  # (it never came to be)
            self.futures.fail(op.future, f"{type(e).__name__}: {e}" if why else str(e),
                              "user" if isinstance(e, UserError | Draining) else "server")

    def sample(self, tenant: str, sampler: dict, frame: SampleF, encode: Encoder,
               record: tuple[list[str], list[int]] | None = None,
               stream: Callable[[list], None] | None = None) -> Future:
        """Sample from a sampler's weights. `record`: (sequence ids, prompt) to keep the
        sampled sequences under, for stable_reinforce; `stream`: fed the new tokens."""
        lane = self.lanes.for_sample(frame.adapter_id)  # (a 400 before any future is made)
        f = self.futures.new(tenant, "sample", encode)
        after: After | None = None
        if record is not None:
            ids, prompt = record

            def after(result: Any, message: str | None) -> None:
                if message is None:
                    self.stability.put(tenant, sampler["session_id"], ids, prompt,
                                       result.sequences)

        after = self.recent_samples.recorder(  # the console's view of the run's samples
            tenant, sampler.get("model_path") or sampler["id"], sampler["id"], frame, after)
        cost = frame.prompt.shape[0] + frame.params.max_tokens * frame.num_samples
        f = self.submit(Op(None, None, frame, f, cost, after=after, stream=stream), lane)
        self.futures.tag(f.id, sampler["id"])  # a session's trace shows it
        return f

    def sample_stream(self, tenant: str, owner: str, frame: SampleF,
                      live: bool = True) -> SampleStream:
        """`sample`, read as pieces of tokens (streams.py); `owner` (a sampler path, or the
        base model's name) is recorded on its future. `live` False: the reader wants the
        pieces only once all are there (a whole answer), so none come before."""
        stream = SampleStream(self.lanes.withdraw)
        # Tokens as they come, unless the reader wants the prompt's scores before them
        # (they come with the result) or reads only the whole. (A sample fed as it runs
        # keeps the workers' sampling slices short: PendingSamples.step.)
        live = None if not live or frame.prompt_logprobs or frame.topk_prompt else stream.feed
        stream.future = self.sample(tenant, {"id": owner}, frame, stream.encode, stream=live)
        return stream

    def finish_session(self, tenant: str, session_id: str, reason: str | None) -> None:
        """A client ended its session: its adapters go once their queued work has run."""
        runs, _ = self.store.sessions.children(session_id)
        if any(self.lanes.of(model).residency.is_open(model) for model in runs):
            self.life.check_intake()  # the unloads would be refused: record nothing either
        self.store.sessions.finish(session_id, reason)
        self.unload_models(tenant, runs)

    def unload_models(self, tenant: str, model_ids: list[str]) -> None:
        """Free the adapters of a finished session, after whatever they still have queued.

        Their runs and checkpoints stay; a training client can be made again from a
        checkpoint. A request that still names such a model gets a clear 400."""
        for model in model_ids:
            lane = self.lanes.of(model)
            if not lane.residency.is_open(model):
                continue
            f = self.futures.new(tenant, "unload", empty_json)
            # A full run's lane is free again once its base model is back (exclusive.py).
            self.submit(Op(model, lane.planner.queues.seq_after_queued(model), UnloadF(model), f,
                           after=lambda _r, _m, m=model: self.lanes.exclusive.release(m)))

    def refresh_tenants(self) -> None:
        """Weights and quotas as the store and config say now (`twinkled ctl tenants set`)."""
        self.tenants.refresh()
