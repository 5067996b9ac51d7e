"""Room for adapters in the workers' GPU memory: every loaded adapter (and one being
created) holds its share of a per-rank budget, and an adapter that would not fit is
refused at the door with the numbers, instead of running a worker out of memory mid-step
(which restarts the group and costs every tenant its step in flight).

The budget is `adapter_memory_gb`, or on GPUs what the sizing estimate leaves of the
smallest card once the base weights, a recomputed training micro-batch and the sampler's
KV pool are counted (`twinkled.server.layout.adapters_budget`); on CPUs there is no limit.
"""

from __future__ import annotations

from collections.abc import Callable

from twinkled.protocol.config import Config
from twinkled.protocol.errors import UserError
from twinkled.protocol.sizing import GiB, adapter_bytes
from twinkled.protocol.types import LoraConfig


class NoRoom(UserError):
    """The adapter would not fit the workers' memory now (a 400 that says why)."""


class AdapterRoom:
    def __init__(self, budget: int | None, size_of: Callable[[LoraConfig], int]):
        """`budget`: bytes per rank for adapters (None: no limit); `size_of(config)`: the
        bytes one adapter of that config takes on a rank."""
        self.budget = budget
        self._size_of = size_of
        self._held: dict[str, int] = {}  # model -> bytes

    def used(self) -> int:
        return sum(self._held.values())

    def fits(self, config: LoraConfig) -> bool:
        """Whether an adapter of `config` fits now."""
        return self.budget is None or self.used() + self._size_of(config) <= self.budget

    def check(self, config: LoraConfig) -> None:
        """Refuse, saying why, an adapter of `config` that does not fit now."""
        if self.fits(config):
            return
        need, used = self._size_of(config), self.used()
        raise NoRoom(
            f"no GPU memory for another adapter: a rank-{config.rank} adapter needs about "
            f"{need / GiB:.2f} GiB per GPU, and the {len(self._held)} loaded adapter(s) "
            f"leave {max(0, self.budget - used) / GiB:.2f} of the {self.budget / GiB:.2f} GiB "
            "this daemon gives adapters (adapter_memory_gb); finish or unload other runs, "
            "or use a lower rank")

    def hold(self, model: str, config: LoraConfig) -> None:
        """`model`'s adapter is loaded (or being created): it holds its bytes."""
        self._held[model] = self._size_of(config)

    def release(self, model: str) -> None:
        self._held.pop(model, None)

    def admit(self, model: str, config: LoraConfig) -> None:
        """check, then hold."""
        self.check(config)
        self.hold(model, config)


def adapter_room(config: Config, budget: int | None) -> AdapterRoom:
    """The adapters' share of GPU memory: the config's `adapter_memory_gb` if set, else
    `budget` (None: no limit), counted with the sizing estimate of this model."""
    if config.adapter_memory_gb > 0:
        budget = int(config.adapter_memory_gb * GiB)
    model = config.model_config or {}
    if budget is None or not model:
        return AdapterRoom(None, lambda _: 0)
    return AdapterRoom(budget, lambda c: adapter_bytes(
        model, c.rank, c.train_attn, c.train_mlp, c.train_unembed, config.tp))
