"""Room for adapters in one tier of memory: every adapter there (and one being created or
brought in) holds its share of a budget. The GPU bank's room is per rank; when it is full,
the least recently used idle adapters are parked to host memory (a second room, per lane)
and on to disk (core/tiers.py), so a worker never runs out of memory mid-step (which
restarts the group and costs every tenant its step in flight) and no tenant is refused for
room: only an adapter larger than the whole GPU budget is, at the door, with the numbers.

The GPU budget is `adapter_memory_gb`, or on GPUs what the sizing estimate leaves of the
smallest card once the base weights, a recomputed training micro-batch and the sampler's
KV pool are counted (`twinkled.server.layout.adapters_budget`); on CPUs there is no limit.
The host budget is `host_adapter_memory_gb`.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from twinkled.protocol.config import Config
from twinkled.protocol.errors import UserError
from twinkled.protocol.sizing import GiB, adapter_bytes, human_size
from twinkled.protocol.types import LoraConfig


class NoRoom(UserError):
    """The adapter could never fit the workers' memory (a 400 that says why)."""


class AdapterRoom:
    def __init__(self, budget: int | None, size_of: Callable[[LoraConfig], int]):
        """`budget`: bytes per rank for adapters (None: no limit); `size_of(config)`: the
        bytes one adapter of that config takes on a rank."""
        self.budget = budget
        self._size_of = size_of
        self._held: dict[str, int] = {}  # model -> bytes

    def used(self) -> int:
        return sum(self._held.values())

    def fits(self, config: LoraConfig, leaving: str | None = None) -> bool:
        """Whether an adapter of `config` fits now (once `leaving`'s bytes are free)."""
        used = self.used() - self._held.get(leaving, 0)
        return self.budget is None or used + self._size_of(config) <= self.budget

    def over(self) -> bool:
        """More is held than the budget allows (a create holds its room at once; the
        least recently used are parked right behind it)."""
        return self.budget is not None and self.used() > self.budget

    def fits_ever(self, config: LoraConfig) -> bool:
        """Whether an adapter of `config` fits with nothing else there."""
        return self.budget is None or self._size_of(config) <= self.budget

    def size(self, config: LoraConfig) -> int:
        return self._size_of(config)

    def check(self, config: LoraConfig) -> None:
        """Refuse, saying why, an adapter of `config` that could never fit the GPU budget
        (one that fits once others are parked is not refused)."""
        if self.fits_ever(config):
            return
        raise NoRoom(
            f"no GPU memory for this adapter: a rank-{config.rank} adapter needs about "
            f"{human_size(self._size_of(config))} per GPU, more than the "
            f"{human_size(self.budget)} this daemon gives adapters (adapter_memory_gb) "
            "even with every other adapter parked; use a lower rank or fewer target modules")

    def hold(self, model: str, config: LoraConfig) -> None:
        """`model`'s adapter is loaded (or being created): it holds its bytes."""
        self._held[model] = self._size_of(config)

    def release(self, model: str) -> None:
        self._held.pop(model, None)

    def held(self, model: str) -> int:
        """The bytes `model` holds here (0: none)."""
        return self._held.get(model, 0)



def check_disk(path: Path, need: int) -> None:
    """Refuse, with the numbers, an adapter whose state (`need` bytes) the disk under
    `path` cannot hold: the last tier, where parked and idle adapters go."""
    while not path.exists() and path != path.parent:
        path = path.parent
    free = shutil.disk_usage(path).free
    if need > free:
        raise NoRoom(f"no disk room for this adapter: its state needs about {human_size(need)} "
                     f"and {path} has {human_size(free)} free; free some disk (old "
                     "checkpoints) or use a lower rank")


def check_cap(config: LoraConfig, size: int, tenant: str, cap: int | None) -> None:
    """Refuse, with the numbers, an adapter larger than `tenant`'s resident cap by itself."""
    if cap is not None and size > cap:
        raise NoRoom(f"a rank-{config.rank} adapter needs about {human_size(size)} per GPU, "
                     f"more than tenant {tenant!r}'s cap of {human_size(cap)} of adapters "
                     "in a GPU bank (max_resident_bytes / tenant_max_resident_bytes); use a "
                     "lower rank or fewer target modules")


def gpu_budget(config: Config, budget: int | None) -> int | None:
    """The bytes per rank adapters may take on GPUs: the config's `adapter_memory_gb` if
    set, else `budget` (`layout.adapters_budget`; None: no limit)."""
    return int(config.adapter_memory_gb * GiB) if config.adapter_memory_gb > 0 else budget


def adapter_room(config: Config, budget: int | None) -> AdapterRoom:
    """The adapters' share of GPU memory (`gpu_budget`), counted with the sizing estimate
    of this model."""
    budget = gpu_budget(config, budget)
    model = config.model_config or {}
    if budget is None or not model:
        return AdapterRoom(None, lambda _: 0)
    return AdapterRoom(budget, lambda c: adapter_bytes(
        model, c.rank, c.train_attn, c.train_mlp, c.train_unembed, config.tp))


def host_room(config: Config) -> AdapterRoom:
    """The host tier's room, per lane (`host_adapter_memory_gb`): a parked adapter's fp32
    weights and moments (12 bytes a parameter; under tensor parallelism each rank holds its
    slices, together the whole). One parked with gradients pending takes 16: the workers
    count what they hold and refuse a park past the budget, and the least recently parked
    then go on to disk (workers/parked.py, Residency._park)."""
    model = config.model_config or {}
    budget = int(config.host_adapter_memory_gb * GiB)
    return AdapterRoom(budget, lambda c: adapter_bytes(
        model, c.rank, c.train_attn, c.train_mlp, c.train_unembed) * 12 // 20)
