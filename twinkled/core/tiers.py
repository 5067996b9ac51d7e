"""Where a lane's training adapters live: the GPU bank, host memory or disk, and in what
order they leave the bank (least recently used first). Torch-free bookkeeping; Residency
(residency.py) makes the moves, through the executor, between steps.

- **GPU bank** (per rank, `adapter_memory_gb`): adapters that can run now. A model with
  queued or running work is never parked.
- **Host memory** (per lane, `host_adapter_memory_gb`): an adapter parked by the worker,
  whole and bit for bit (weights, pending gradients, moments: workers/parked.py).
- **Disk**: its persisted state and the journal's ops after it, as for an adapter unloaded
  while idle; brought back by the same restore (core/recovery.py).

A request for a parked adapter waits at the door while it is brought in (Residency
`ensure_loaded`), parking others if the bank is full, and waiting for one to go idle if
every resident adapter has work queued: capacity is never a refusal. On a one-rank lane
the moves between the bank and host memory run inside the training step in flight, between
two of its micro-batches (on a GPU the copy is on a side stream, overlapping that step's
kernels): the adapter is in before the next step is planned, a prefetch "hit"; a move that
ran between steps while other work waited is a "miss". The workers' time a move takes is
charged to the fair share of the tenant whose adapter needed it. The worker's host
memory dies with it: after a group restart what was on the host tier is on disk.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable

from twinkled.core.adapter_room import AdapterRoom
from twinkled.protocol.sizing import human_size
from twinkled.protocol.types import LoraConfig

# A park of an adapter that ran or was asked for this recently is churn: the runs training at
# the same moment do not fit the bank, and steps move adapters instead of training. Measured:
# gpt-oss-20b's 6 GiB adapters, 8 tinker tenants, a bank of 6-7, 245 tok/s against 4,205 with
# room for all 8 (BENCHMARKS.md row 40). The operator hears of it (Residency logs a warning)
# when CHURN_WARN such parks fall within CHURN_WINDOW_S, at most once per CHURN_QUIET_S.
CHURN_RECENT_S = 10.0
CHURN_WARN = 4
CHURN_WINDOW_S = 60.0
CHURN_QUIET_S = 600.0


class Tiers:
    def __init__(self, gpu: AdapterRoom, host: AdapterRoom):
        self.gpu, self.host = gpu, host
        self._used: dict[str, float] = {}  # model -> when it last ran or was asked for
        self._on_host: dict[str, LoraConfig] = {}
        self.moves: Counter[str] = Counter()  # "to_host", "to_disk", "from_host", "from_disk"
        self.moved_bytes = 0
        # Bring-ins that held up no step (inside the step in flight, or while no other work
        # waited) and those that did: the prefetch hit rate.
        self.prefetch: Counter[str] = Counter()  # "hits", "misses"
        self.churn = 0  # parks of adapters used within CHURN_RECENT_S
        self.started_parked = 0  # new runs that started on disk (Residency.start_parked)
        self._unborn: set[str] = set()  # those of them not brought in yet
        self._churned: list[float] = []  # when, within the last CHURN_WINDOW_S
        self._warned = -CHURN_QUIET_S

    def touch(self, model: str) -> None:
        """The model was asked for or ran: the last to be parked."""
        self._used[model] = time.monotonic()

    def forget(self, model: str) -> None:
        self._used.pop(model, None)
        self.left_host(model)

    def last_used(self, model: str) -> float:
        return self._used.get(model, 0.0)

    # -- the GPU bank ---------------------------------------------------------------------

    def parked(self, model: str) -> bool:
        """Count `model`'s park out of the bank (before it is forgotten); True when the bank
        churns enough that the operator should hear of it (at most once per CHURN_QUIET_S)."""
        now = time.monotonic()
        if model not in self._used or now - self._used[model] > CHURN_RECENT_S:
            return False
        self.churn += 1
        self._churned = [t for t in self._churned if now - t < CHURN_WINDOW_S] + [now]
        if len(self._churned) < CHURN_WARN or now - self._warned < CHURN_QUIET_S:
            return False
        self._warned = now
        return True

    def churn_warning(self, resident: int) -> str:
        """What the operator reads when the bank churns (`resident`: adapters in it)."""
        def size(n: int | None) -> str:
            return "no limit" if n is None else human_size(n)

        return (f"the GPU bank is too small for the runs training now: {self.churn} parks so "
                f"far of adapters used within {CHURN_RECENT_S:.0f} s (the bank holds "
                f"{resident}, {size(self.gpu.used())} of adapter_memory_gb's "
                f"{size(self.gpu.budget)}; host memory {size(self.host.used())} of "
                f"{size(self.host.budget)}). Steps move adapters instead of training: raise "
                "adapter_memory_gb, lower token_budget to the most tokens one step holds (the "
                "default bank is what is left beside a micro-batch of token_budget), or raise "
                "host_adapter_memory_gb so that parks stay off the disk (docs/operator.md 5d)")

    def coldest(self, resident: Iterable[str], exclude: str | None = None) -> list[str]:
        """Resident models, least recently used first: the order they are parked in."""
        return sorted((m for m in resident if m != exclude), key=self.last_used)

    # -- host memory ----------------------------------------------------------------------

    def on_host(self, model: str) -> bool:
        return model in self._on_host

    def on_host_models(self) -> list[str]:
        """Parked in host memory, least recently used first (the next to go to disk)."""
        return sorted(self._on_host, key=self.last_used)

    def to_host(self, model: str, config: LoraConfig) -> None:
        self.host.hold(model, config)
        self._on_host[model] = config
        self.moved(model, "to_host", config)

    def left_host(self, model: str) -> LoraConfig | None:
        self.host.release(model)
        return self._on_host.pop(model, None)

    def host_lost(self) -> None:
        """The worker group restarted: what was in its host memory is on disk now."""
        for model in list(self._on_host):
            self.left_host(model)

    def start_parked(self, model: str) -> None:
        """A new run starts on disk, with no state there (Residency.start_parked)."""
        self.started_parked += 1
        self._unborn.add(model)

    def born(self, model: str) -> bool:
        """Whether `model` started parked and comes in for the first time now: made from
        its seed, not moved (no move counted, nothing read from disk)."""
        if model in self._unborn:
            self._unborn.discard(model)
            return True
        return False

    def hand_over(self, model: str, to: Tiers) -> None:
        """`model` comes in on another lane (Lanes.ensure_loaded): a new run that started
        parked here is still one there."""
        if self.born(model):
            to._unborn.add(model)

    def moved(self, model: str, kind: str, config: LoraConfig) -> None:
        self.moves[kind] += 1
        self.moved_bytes += self.host.size(config)

    def prefetched(self, hit: bool) -> None:
        self.prefetch["hits" if hit else "misses"] += 1

    def status(self) -> dict:
        """Adapters and bytes per tier, and the moves so far (`ctl status`, /metrics)."""
        return {"gpu_bytes": self.gpu.used(), "gpu_budget": self.gpu.budget,
                "host": len(self._on_host), "host_bytes": self.host.used(),
                "host_budget": self.host.budget, "moves": dict(self.moves),
                "moved_bytes": self.moved_bytes, "prefetch": dict(self.prefetch),
                "churn": self.churn, "started_parked": self.started_parked}
