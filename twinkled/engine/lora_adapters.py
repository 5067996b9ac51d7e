"""An engine's LoRA adapters: what engine.py does with the adapters of its pool (lora.py),
as full_param.FullSlot is what it does with a full-parameter run.

Adding one (seeded alike on every rank under tensor parallelism), copying one on the
device, loading a checkpoint into one (checked whole before anything changes), its
optimizer step (gradients summed over the ranks that hold parts of them first) and
clearing its gradients. The engine decides which of the two an adapter id is.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from twinkled.protocol.checks import check_optim_params
from twinkled.protocol.types import (
    AdapterInfo,
    EngineInputError,
    LoraConfig,
    OptimParams,
    OptimResult,
)

from . import live, state
from .lora import LoraPool
from .model import BaseModel
from .moe_parallel import ExpertSplit, reduce_split_gradients
from .optim import optimizer_steps
from .parallel import reduce_gradients


class LoraAdapters:
    """The LoRA adapters of `pool` over `model`; `shard`, `experts` and `dp_group`: how
    the engine is split (its tensor-parallel slice, its share of an MoE model's experts,
    its data-parallel group: engine.Engine)."""

    def __init__(self, pool: LoraPool, model: BaseModel, shard=None,
                 experts: ExpertSplit | None = None, dp_group=None):
        self.pool, self.model, self.shard = pool, model, shard
        self.experts, self.dp_group = experts, dp_group

    def add(self, adapter_id: str, config: LoraConfig) -> None:
        if self.shard is not None:
            config = self._split_config(config)
        self.pool.add(adapter_id, config)

    def _split_config(self, config: LoraConfig) -> LoraConfig:
        """Under tensor parallelism an unseeded adapter gets a seed all ranks share."""
        if config.seed is None:
            config = replace(config, seed=self.shard.tp.broadcast_seed())
        return config

    def copy(self, src: str, dst: str) -> None:
        """A new adapter `dst` with `src`'s configuration and current weights (copied on
        the device), but none of its gradients or optimizer state."""
        a = self.pool.get(src)
        b = self.pool.add(dst, a.config, init=False)  # (its weights: src's, below)
        try:
            with torch.no_grad():
                torch._foreach_copy_(b.bank.tensors(b.slot, "w"), a.bank.tensors(a.slot, "w"))
        except BaseException:
            self.pool.remove(dst)
            raise
        b.bank.changed(b.slot)  # its compute-dtype copy follows at the next use
        b.steps = a.steps

    def info(self, adapter_id: str) -> AdapterInfo:
        a = self.pool.get(adapter_id)
        c = a.config
        return AdapterInfo(adapter_id, c.rank, c.alpha, c.target_modules, a.steps, a.pending,
                           c.optimizer)

    def step(self, items: list[tuple[str, OptimParams]], spread: set[str]) -> list[OptimResult]:
        """The adapters' optimizer steps, each of its own family (checked first). `spread`:
        the adapters whose gradients this rank holds parts of split rows of (context
        parallelism); they are summed over the group, and leave it."""
        ids = [i for i, _ in items]
        adapters = [self.pool.get(i) for i in ids]
        for adapter, (_, params) in zip(adapters, items, strict=True):
            check_optim_params(adapter.config.optimizer, params)
        if self.shard is not None:
            self.shard.reduce_grads(adapters)
        if self.experts is not None:
            reduce_split_gradients(adapters, self.dp_group)
        elif self.dp_group is not None:
            reduce_gradients(adapters, self.dp_group, spread)
        spread.difference_update(ids)
        return optimizer_steps(list(zip(adapters, [p for _, p in items], strict=True)),
                               self.shard)

    def zero_grad(self, adapter_id: str) -> None:
        a = self.pool.get(adapter_id)
        a.bank.zero_slot(a.slot)
        a.pending = 0

    def load(self, adapter_id: str, path: str | Path, optimizer: bool,
             optimizer_type: str | None, lane_full: bool) -> None:
        """Load a LoRA checkpoint (or a worker's live state) into `adapter_id`, creating
        it if needed (its shape is the file's). `lane_full`: a full run holds this lane,
        where a new LoRA adapter may not be made.

        With `optimizer`, the optimizer state and its family come from the checkpoint (as
        Tinker's full-state resume keeps Dimuon), and an existing adapter must be of that
        family. Without, a new adapter gets `optimizer_type` (default AdamW) and fresh state.
        Everything is read and checked before the adapter changes."""
        if live.is_live(path):  # a worker's persisted state (see workers/persist.py)
            config, weights, moments, steps = live.read_live(path)
        else:
            config, weights, moments, steps = state.read_adapter(
                path, self.model.targets, self.pool.max_rank, optimizer)
        if not optimizer:  # (a live state holds moments whatever was asked: drop them)
            config, moments = replace(config, optimizer=optimizer_type or "adamw"), None
        elif optimizer_type is not None and optimizer_type != config.optimizer:
            raise EngineInputError("optimizer_config.type", f"the checkpoint's optimizer state "
                                   f"is {config.optimizer!r}, not {optimizer_type!r}")
        if adapter_id in self.pool.adapters:
            current = self.pool.get(adapter_id).config
            if (current.rank, current.target_modules) != (config.rank, config.target_modules):
                raise EngineInputError(
                    "path", f"checkpoint has rank {config.rank} on {config.target_modules}, "
                    f"adapter {adapter_id!r} has rank {current.rank} on {current.target_modules}")
            if optimizer and current.optimizer != config.optimizer:
                raise EngineInputError(
                    "path", f"checkpoint holds {config.optimizer!r} optimizer state; adapter "
                    f"{adapter_id!r} was created with {current.optimizer!r}")
            config = current
        elif lane_full:  # (the daemon sends no LoRA weights here: core/lanes.py)
            raise EngineInputError("path", "this lane trains a full-parameter run; its base "
                                   "model is not the one LoRA adapters apply to")
        else:
            self.pool.add(adapter_id, config, init=False)  # (written next)
        state.write_into(self.pool.get(adapter_id), weights, moments, steps if optimizer else 0,
                         self.shard)
