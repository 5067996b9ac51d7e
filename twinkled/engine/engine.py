"""The engine: one base model, a pool of LoRA adapters, and what can be done with them.

This is what a worker process (or twinkle_sdk's local mode) drives. It knows nothing of
tenants, HTTP or SQL: adapters are named by opaque ids chosen by the caller.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from twinkled.protocol.checks import check_optimizer
from twinkled.protocol.sizing import FULL_RUN_KV_BYTES
from twinkled.protocol.types import (
    AdamParams,
    AdapterInfo,
    Datum,
    DimuonParams,
    EngineInputError,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    LogprobGap,
    LoraConfig,
    OptimResult,
    SampledSequence,
    SampleRequest,
    SampleResult,
)

from . import sampler, state, step
from .context_parallel import ContextParallel
from .full_param import FullRun, FullSlot, is_full_checkpoint
from .fused_ops import Fused
from .lora import Adapter, LoraPool
from .lora_adapters import LoraAdapters
from .lora_bank import Bank
from .model import BaseModel
from .moe_parallel import ExpertSplit
from .pinned import exact_sizes
from .running import KV_BYTES, Finished, RunningBatch, pool_tokens
from .running_slot import RunningSlot
from .shared_prefix import MIN_SHARED
from .validate import check_forward_backward, check_sample


class Engine:
    """Load `model_dir` on `device` in `dtype`; adapters up to `max_rank`.

    `token_budget` caps the tokens of one micro-batch (activation memory); a larger call is
    split and its gradients accumulated. `packed`: a micro-batch's rows run end to end as
    one sequence (it costs its tokens), rather than padded to its longest row.
    """

    def __init__(self, model_dir: str | Path, *, dtype: str | torch.dtype = "float32",
                 device: str | torch.device = "cpu", max_rank: int = 128,
                 token_budget: int = 16384, packed: bool = True, dp_group=None, tp=None,
                 recompute: str = "auto", kv_bytes: int | None = None,
                 experts: ExpertSplit | None = None, prefix_cache: float = 0.0,
                 shared_prefix: int = MIN_SHARED, fused: str = "all", sample_rows: int = 256,
                 rope_scaling: dict | None = None, max_seq_len: int | None = None,
                 bank_max_bytes: int | None = None):
        # `tp` (tp.py: TensorParallel): this rank holds a slice of the base model and of
        # every adapter; `dp_group` is then the group across the replicas. `experts`
        # (moe_parallel.py): this rank's share of an MoE model's experts. `rope_scaling`,
        # `max_seq_len`: rows longer than the model's config (long_context.py).
        # `bank_max_bytes`: the bytes adapters may take on this rank (the daemon's adapter
        # budget): no LoRA bank grows past them; None: no cap.
        self.model = BaseModel(model_dir, dtype=dtype, device=device, tp=tp, experts=experts,
                               rope_scaling=rope_scaling, max_seq_len=max_seq_len)
        if self.model.device.type == "cuda":
            exact_sizes()  # before any pinned allocation: exact sizes, no rounding (pinned.py)
        self.shard = self.model.shard  # None unless split
        self.model.recompute.set_mode(recompute)  # activation checkpointing (recompute.py)
        self.model.fused = Fused.parse(fused)  # the layer's fused kernels (fused_ops.py)
        self.pool = LoraPool(self.model.targets, max_rank, self.model.device, self.model.dtype,
                             shard=self.shard, bank_max_bytes=bank_max_bytes)
        self.token_budget = token_budget
        self.packed = packed  # rows end to end in a micro-batch, not padded (packed.py)
        # Packed rows of one adapter whose first this many positions agree compute them
        # once (shared_prefix.py); 0: never. Not for linear attention (Qwen3.5): rows that
        # continue a shared start would need its recurrent state, which that layout lacks;
        # nor for gpt-oss, whose attention (sinks, windows) that layout does not run yet.
        plain = self.model.hybrid is None and self.model.sinks is None
        self.shared_prefix = shared_prefix if plain else 0
        # Set in a data-parallel worker group: gradients are summed over it before a step.
        # With expert parallelism (`experts`), expert gradients are summed over the world
        # and dp_group is the data-parallel group, or None if there is none.
        self.dp_group = dp_group
        # Sampling's running batch, kept from one call to the next (running_slot.py). Its
        # rows: a decode step's time grows almost linearly with them (per-row KV, LoRA and
        # sampling work, not the weights, bound it on an 8B), so more rows buy throughput
        # for large RL batches at the cost of each token's latency.
        self._running = RunningSlot(self.model, sample_rows, prefix_cache)
        self.kv_bytes = kv_bytes  # its page pool's size (None: running.KV_BYTES)
        # Models sample in the running batch, MoE ones included (Qwen3-MoE, Mixtral,
        # gpt-oss, DeepSeek-V3, Qwen3.5-MoE, Qwen3-VL-MoE): its experts' LoRA per row
        # (moe.ExpertRows), its decode eager (no CUDA graph captures the data-dependent
        # routing: running.py); DeepSeek's pages hold its MLA latents (mla.py). Under --ep
        # or --tp its samples run to the end, not in slices cut by time (workers/sampling.py).
        # A dense tensor-parallel model samples with the padded sampler: the running batch
        # runs under tp but decodes eagerly there, 0.70x the padded sampler at 8B tp 2
        # (BENCHMARKS.md, session 12; docs/internals.md). Where it decodes eagerly at tp 1
        # too (Qwen3.5, MoE models) it keeps the running batch under tp.
        self.padded_sampling = (self.shard is not None and self.model.hybrid is None
                                and not self.model.moe)
        self.experts = experts
        self.lora = LoraAdapters(self.pool, self.model, self.shard, experts, dp_group)
        # Adapters whose gradients this rank holds parts of split rows of (context
        # parallelism), until their optimizer step sums them over the group (parallel.py).
        self.spread: set[str] = set()
        # A full-parameter run (rank 0, full_param.py): it trains this engine's base model
        # itself, so it is the only training run here.
        self._full = FullSlot(self.model, dp_group)

    @property
    def full(self) -> FullRun | None:
        return self._full.run

    @property
    def tokenizer(self):
        return self.model.tokenizer

    # -- adapters ---------------------------------------------------------------------

    def add_adapter(self, adapter_id: str, config: LoraConfig | None = None) -> AdapterInfo:
        config = config or LoraConfig()
        if config.rank == 0:
            info = self._full.start(adapter_id, config, self.pool.adapters)
            self._pool_for_full_run()
            return info
        if self.full is not None:
            raise EngineInputError("lora_config.rank", "this lane trains a full-parameter run; "
                                   "its base model is not the one LoRA adapters train on")
        self.lora.add(adapter_id, config)
        return self.adapter_info(adapter_id)

    def is_full(self, adapter_id: str | None) -> bool:
        """Whether `adapter_id` is the full run, or a sampler view of its weights."""
        return self._full.holds(adapter_id)

    def when_bank_full(self, make_room: Callable[[Bank], None]) -> None:
        """`make_room(bank)` runs before a new adapter would grow `bank` past the budget
        (`bank_max_bytes`): the worker's samplers leave it (LoraPool.at_budget)."""
        self.pool.at_budget = make_room

    def copy_adapter(self, src: str, dst: str) -> AdapterInfo:
        """A new adapter `dst` with `src`'s configuration and current weights, but none of
        its gradients or optimizer state: a sampler of a live adapter made on the device,
        instead of reading back the files just written (they hold the same fp32 masters).
        Of a full run: a view of its current weights (nothing is copied)."""
        if self.is_full(src):
            return self._full.view(dst)
        self.lora.copy(src, dst)
        return self.adapter_info(dst)

    def remove_adapter(self, adapter_id: str) -> None:
        ended = self._full.drop(adapter_id)
        if ended is None:
            self.pool.remove(adapter_id)
        elif ended:
            self._running.drop()  # its pages and cached prefixes were of the run's weights

    def has_adapter(self, adapter_id: str) -> bool:
        return adapter_id in self.pool.adapters or self.is_full(adapter_id)

    def adapter_info(self, adapter_id: str) -> AdapterInfo:
        if self.is_full(adapter_id):
            return self.full.info()
        return self.lora.info(adapter_id)

    # -- training ---------------------------------------------------------------------

    def check(self, request: ForwardBackwardRequest | SampleRequest) -> None:
        """Raise EngineInputError naming the field if the request cannot run."""
        if isinstance(request, SampleRequest):
            check_sample(request, self.model, self.pool)
        else:
            check_forward_backward(request, self.model, self.pool)

    def forward_backward(self, requests: list[ForwardBackwardRequest],
                         checked: bool = False, micro_tokens: int = 0,
                         between: Callable[[], None] | None = None,
                         cp: ContextParallel | None = None) -> list[ForwardBackwardResult]:
        """Run several requests (any adapters, forward-only or not) as shared passes.

        Gradients accumulate per adapter until its `optim_step`. All requests are checked
        first: if one is bad, nothing runs and nothing changes. `checked`: the caller
        already did (the daemon checks at its door). `micro_tokens`: micro-batches of at
        most this many tokens (0: `token_budget`); `between`: called between them
        (step.forward_backward: the step is preemptible there). `cp`: long rows are split
        over this context-parallel group (context_parallel.py); every rank of it must make
        this call alike, with the same long rows (workers/runner.py).
        """
        full = [self.is_full(r.adapter_id) for r in requests]
        if any(full):  # the base model is the run's: its rows train it (full_param.py)
            requests = [replace(r, adapter_id=None) if f else r
                        for r, f in zip(requests, full, strict=True)]
        if not checked:  # (a full run's rows as the base model's, which may not train)
            for r, f in zip(requests, full, strict=True):
                self.check(replace(r, forward_only=True) if f else r)
        adapters = [None if r.adapter_id is None else self.pool.get(r.adapter_id) for r in requests]
        budget = min(micro_tokens, self.token_budget) if micro_tokens > 0 else self.token_budget
        if cp is not None:
            self.spread.update(r.adapter_id for r in requests if r.adapter_id is not None
                               and not r.forward_only
                               and any(cp.splits(len(d.tokens)) for d in r.data))
        if all(r.forward_only for r in requests):
            with torch.no_grad():
                return step.forward_backward(self.model, requests, adapters, budget,
                                             self.packed, self.shared_prefix, between, cp)
        results = step.forward_backward(self.model, requests, adapters, budget, self.packed,
                                        self.shared_prefix, between, cp,
                                        base_trains=any(full))
        for r, f in zip(requests, full, strict=True):
            if f and not r.forward_only:
                self.full.trained(len(r.data))
        return results

    def forward(self, requests: list[ForwardBackwardRequest]) -> list[ForwardBackwardResult]:
        """Logprobs (and loss values) only; changes nothing."""
        return self.forward_backward([replace(r, forward_only=True) for r in requests])

    def logprob_gap(self, adapter_id: str | None, prompt: list[int], tokens: list[int],
                    logprobs: list[float]) -> LogprobGap:
        """How far a finished sample's logprobs (`tokens` generated after `prompt`, as
        `sample` returned them) are from the trainer's: the same tokens through the
        forward that forward_backward runs (no gradients), scored at temperature 1. Only a
        sample drawn at temperature 1 (or greedy) is comparable: others' logprobs are of
        the scaled distribution."""
        seq = [*prompt, *tokens]
        datum = Datum(seq[:-1], {"target_tokens": seq[1:]})
        out = self.forward([ForwardBackwardRequest(adapter_id, [datum])])[0]
        trainer = out.outputs[0]["logprobs"][len(prompt) - 1:].double()
        gap = (trainer - torch.tensor(logprobs, dtype=torch.float64)).abs()
        return LogprobGap(float(gap.mean()), float(gap.max()), len(tokens))

    def optim_step(self, adapter_id: str,
                   params: AdamParams | DimuonParams | None = None) -> OptimResult:
        """The adapter's optimizer (AdamW or Dimuon, chosen at its creation) on the gradients
        accumulated since its last step (then cleared). `params` must be of that family;
        None means AdamW's defaults (Dimuon's learning_rate has no default)."""
        return self.optim_steps([(adapter_id, params or AdamParams())])[0]

    def optim_steps(self, items: list[tuple[str, AdamParams | DimuonParams]]) -> list[OptimResult]:
        """Several adapters' optimizer steps at once (cheaper than one call each), of either
        family. Everything is checked first: a bad item fails the call and changes nothing."""
        ids = [i for i, _ in items]
        if len(set(ids)) != len(ids):
            raise EngineInputError("adapter_id", "an adapter may step only once per call")
        if any(self.is_full(i) for i in ids):  # alone on its lane: one item
            if len(items) != 1:
                raise EngineInputError("adapter_id", "a full run steps alone")
            result = self.full.step(items[0][1])
            self._running.drop(only_idle=True)  # cached prefixes were of the weights before
            return [result]
        return self.lora.step(items, self.spread)

    def zero_grad(self, adapter_id: str) -> None:
        if self.is_full(adapter_id):
            self.full.zero_grad()
            return
        self.lora.zero_grad(adapter_id)
        self.spread.discard(adapter_id)

    # -- sampling ---------------------------------------------------------------------

    def sample(self, requests: list[SampleRequest], checked: bool = False) -> list[SampleResult]:
        """Sample every request and wait for all of them. Requests queued by
        `sample_submit` keep running meanwhile; those that finish wait for `sample_slice`."""
        if self.padded_sampling:
            adapters = self._sample_adapters(requests, checked)
            if self.shard is not None:  # unseeded draws must agree over the group
                torch.manual_seed(self.shard.tp.broadcast_seed())
            return sampler.generate_padded(self.model, requests, adapters)
        batch, adapters = self._sampling_batch(requests, checked)
        return self._running.generate(batch, requests, adapters)

    def _pool_bytes(self) -> int | None:
        """The KV pool a new running batch gets: the configured one (None: the device's
        default), but while a full run lives at most FULL_RUN_KV_BYTES, the pool the
        daemon's memory estimate leaves beside the run's state (sizing.full_run_problem);
        a request that needs more still grows it (RunningBatch.sized_for)."""
        if self.full is None:
            return self.kv_bytes
        default = KV_BYTES.get(self.model.device.type, KV_BYTES["cuda"])
        return min(self.kv_bytes or default, FULL_RUN_KV_BYTES)

    def _pool_for_full_run(self) -> None:
        """A full run began: an idle pool made before it (of the configured size, and of
        the base weights' prefixes) goes, so that its memory is the run's; the next sample
        makes one of `_pool_bytes`."""
        if self.full is not None:
            self._running.drop(only_idle=True)

    @property
    def kv_tokens(self) -> int:
        """The longest sequence the sampler's KV pool holds at its configured size (0: no
        such bound, where sampling runs padded, without the pool)."""
        return 0 if self.padded_sampling else pool_tokens(self.model, self.kv_bytes)

    @property
    def kv_pages(self) -> int:
        """Pages in the sampler's KV pool (0 before the first sample)."""
        return self._running.pages

    def sample_submit(self, requests: list[SampleRequest], checked: bool = False) -> list[int]:
        """Queue requests in the running batch; returns their tickets. They run, beside
        later ones, in `sample_slice` calls (which return them when they finish)."""
        batch, adapters = self._sampling_batch(requests, checked)
        return batch.admit(requests, adapters)

    def sample_slice(self, max_steps: int | None = None, max_seconds: float | None = None,
                     until_done: bool = False, min_seconds: float = 0.0,
                     stop: Callable[[], bool] | None = None) -> list[Finished]:
        """Run the queued requests for up to `max_steps` decode steps / `max_seconds` (with
        `until_done`, only until one finishes and `min_seconds` passed; with `stop`, until
        it says so, asked between steps); returns those that finished. If a step fails,
        every queued request is lost (the batch starts afresh) and the error propagates."""
        return self._running.run(max_steps, max_seconds, until_done, min_seconds, stop)

    def sample_pieces(self) -> dict[int, list[list[int]]]:
        """Tokens each running ticket's samples generated since the last call."""
        return self._running.pieces()

    def sample_partials(self, tickets: list[int] | None = None
                        ) -> dict[int, list[SampledSequence]]:
        """`sample_pieces` with each token's logprob and top-k row (stop_reason ""), of
        `tickets` if given."""
        return self._running.partials(tickets)

    def sample_cancel(self, ticket: int) -> bool:
        """Drop a submitted request (queued or running; its pages are freed at once);
        False if it already finished."""
        return self._running.cancel(ticket)

    def sample_fits(self, request: SampleRequest) -> bool:
        """Whether the running batch can take `request` now (it may wait there for room);
        False: only once the batch is idle (`sample_idle`: it then grows to hold it)."""
        return self._running.fits(request)

    @property
    def sample_idle(self) -> bool:
        """No submitted request is queued or running."""
        return self._running.idle

    @property
    def sample_waiting(self) -> int:
        """Submitted requests waiting for room in the running batch."""
        return self._running.waiting

    @property
    def sample_stocked(self) -> bool:
        """As many rows wait for room as the running batch decodes at once."""
        return self._running.stocked

    def _sample_adapters(self, requests: list[SampleRequest], checked: bool
                         ) -> list[Adapter | None]:
        """Each request's adapter (None: the base model), after checking the requests."""
        if not checked:
            for r in requests:
                self.check(replace(r, adapter_id=None) if self.is_full(r.adapter_id) else r)
        # A full run samples from the base model, which is its current weights.
        return [None if r.adapter_id is None or self.is_full(r.adapter_id)
                else self.pool.get(r.adapter_id) for r in requests]

    def _sampling_batch(self, requests: list[SampleRequest], checked: bool
                        ) -> tuple[RunningBatch, list[Adapter | None]]:
        adapters = self._sample_adapters(requests, checked)
        if self.shard is not None:  # unseeded draws must agree over the group
            torch.manual_seed(self.shard.tp.broadcast_seed())
        return self._running.batch_for(requests, self._pool_bytes()), adapters

    # -- state ------------------------------------------------------------------------

    def save(self, adapter_id: str, path: str | Path, optimizer: bool = True,
             write: bool = True) -> int:
        """Write a checkpoint directory (PEFT adapter, plus optimizer state); returns bytes.

        Under tensor parallelism every rank of the group must call it (the tensors are
        gathered whole); only those with `write` write the files. A full run's is a Hugging
        Face model directory (full_param.py)."""
        if self.is_full(adapter_id):
            return self.full.save(path, optimizer, write)
        snap = self.snapshot(adapter_id, optimizer)
        return state.write_snapshot(snap, path, str(self.model.dir)) if write else 0

    def snapshot(self, adapter_id: str, optimizer: bool = True) -> state.Snapshot:
        """The adapter's whole tensors at this instant (collective under tensor
        parallelism)."""
        return state.snapshot(self.pool.get(adapter_id), optimizer, self.shard)

    def load(self, adapter_id: str, path: str | Path, optimizer: bool = True,
             optimizer_type: str | None = None, new_full: bool = False) -> AdapterInfo:
        """Load a checkpoint into `adapter_id`, creating it if needed (its shape is the file's).
        `new_full`: a training run's load, which a full run's checkpoint makes a full run
        of where this engine holds no run (a sampler's load only reads the live one).
        `optimizer`: the optimizer state and its family come from the checkpoint; without,
        a new adapter gets `optimizer_type` (default AdamW): LoraAdapters.load.
        """
        if optimizer_type is not None:
            check_optimizer(optimizer_type)
        if is_full_checkpoint(path) or self.is_full(adapter_id):
            info = self._full.load(adapter_id, path, optimizer, new_full, self.pool.adapters)
            self._pool_for_full_run()
            return info
        self.lora.load(adapter_id, path, optimizer, optimizer_type, self.full is not None)
        return self.adapter_info(adapter_id)
