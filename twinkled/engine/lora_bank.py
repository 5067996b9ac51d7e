"""A bank of LoRA adapters: adapters of one (rank, targets) shape side by side, their
weights, gradients and AdamW moments in flat buffers (one per kind of state), grown on the
card as adapters arrive. The multi-LoRA layer that reads them is lora.py.
"""

from __future__ import annotations

import itertools
import math

import torch

BIG_BANK_BYTES = 2 * 2**30
# Weight versions, unique across every bank and slot of the process: a slot's version
# changes with every write to its weights (`Bank.changed`), so a version names one set of
# weights for good (the sampler's prefix cache keys KV pages on it).
_VERSIONS = itertools.count(1)


class BankGrowthError(torch.OutOfMemoryError):
    """A bank ran out of memory growing; it is left as it was, at its old capacity."""


class Bank:
    """Adapters of one (rank, targets) shape. Slots are reused after removal.

    Each kind of state (weights "w", gradients "g", moments "m" and "v") is one buffer
    [capacity, slot_numel], slot-major: an adapter's whole state of a kind is one
    contiguous row, and the per-module A [slots, r, in] and B [slots, out, r] are strided
    views into it. The optimizer, the gradient all-reduce and zeroing then run on one
    tensor per adapter instead of two per module: a 0.5B model's 336 tensors per adapter
    cost more host time (kernel arguments, views) than the arithmetic.
    """

    KINDS = ("w", "g", "m", "v")

    def __init__(self, rank: int, targets: dict[str, tuple[int, int]], device,
                 dtype: torch.dtype = torch.float32, capacity: int = 4,
                 max_bytes: int | None = None):
        """`max_bytes`: the bytes the daemon lets this rank's adapters take (its accounting
        decides which are resident); growth stops there rather than overshoot it by a
        doubling or a quarter, but always takes at least one more slot. None: no cap."""
        self.rank = rank
        # key -> (in_features, out_features), or (in, out, experts) for an MoE layer's expert
        # parameter: each expert has its own pair, A [experts, r, in] and B [experts, out, r].
        self.shapes = targets
        # Where its rows go in a mixed batch: the same on every rank of a tensor-parallel or
        # expert group (an id() would differ between processes, and the group's
        # collectives would then combine different rows).
        self.order = (rank, tuple(sorted(targets)))
        self.device = device
        # Batches run in the base model's dtype; a bf16 copy of the fp32 master weights,
        # refreshed after each change, spares every layer a cast per step.
        self.dtype = dtype
        self.A16: dict[str, torch.Tensor] = {}
        self.B16: dict[str, torch.Tensor] = {}
        self.stale: set[int] = set()
        self.dirty: set[int] = set()  # slots whose gradients wait in the scratch (`flush`)
        self.versions: dict[int, int] = {}  # slot -> its weights' version (`changed`)
        self.capacity = 0
        self.free: list[int] = []
        # Where each module's A and B sit in a slot's row: A of every key, then B of every
        # key (the order of `tensors`).
        self._layout: list[tuple[str, str, tuple[int, ...], int]] = []
        at = 0
        for part in ("A", "B"):
            for key, (fin, fout, *experts) in targets.items():
                shape = (*experts, rank, fin) if part == "A" else (*experts, fout, rank)
                self._layout.append((part, key, shape, at))
                at += math.prod(shape)
        self.slot_numel = at
        self._flat: dict[str, torch.Tensor] = {}
        self.A: dict[str, torch.Tensor] = {}
        self.B: dict[str, torch.Tensor] = {}
        self.gA: dict[str, torch.Tensor] = {}
        self.gB: dict[str, torch.Tensor] = {}
        self.mA: dict[str, torch.Tensor] = {}  # AdamW first moments (Dimuon: momentum)
        self.mB: dict[str, torch.Tensor] = {}
        self.vA: dict[str, torch.Tensor] = {}  # AdamW second moments
        self.vB: dict[str, torch.Tensor] = {}
        self._views: dict[tuple, list[torch.Tensor]] = {}
        self.max_bytes = max_bytes
        self._grow(self._capped(capacity))

    def _stores(self, kind: str) -> tuple[dict, dict]:
        return {"w": (self.A, self.B), "g": (self.gA, self.gB), "w16": (self.A16, self.B16),
                "m": (self.mA, self.mB), "v": (self.vA, self.vB)}[kind]

    def slot_bytes(self) -> int:
        """Bytes a slot takes: fp32 weights, gradients and moments, and two compute-dtype
        buffers, the copy of the weights and the gradient scratch (`scratch`); none apart
        in fp32, where both are fp32 kinds themselves. protocol/sizing.adapter_bytes
        counts the same."""
        copies = 0 if self.dtype == torch.float32 else 2 * self.dtype.itemsize
        return self.slot_numel * (4 * len(self.KINDS) + copies)

    def _cap_slots(self) -> int | None:
        """The slots `max_bytes` holds (None: no cap)."""
        return None if self.max_bytes is None else self.max_bytes // self.slot_bytes()

    def _capped(self, capacity: int) -> int:
        """`capacity`, or fewer slots where `max_bytes` holds fewer: never fewer than one
        more than now."""
        cap = self._cap_slots()
        return capacity if cap is None else min(capacity, max(self.capacity + 1, cap))

    def at_cap(self) -> bool:
        """Every slot the budget (`max_bytes`) holds is made: a growth goes past it."""
        cap = self._cap_slots()
        return cap is not None and self.capacity >= cap

    def _zeros(self, capacity: int) -> torch.Tensor:
        return torch.zeros((capacity, self.slot_numel), dtype=torch.float32,
                           device=self.device)

    def _view_stores(self, capacity: int) -> None:
        """Every store's per-module views (A, gA, ... A16) into the flat buffers, which
        hold `capacity` rows."""
        for kind in (*self.KINDS, "w16"):
            flat, stores = self._flat[kind], self._stores(kind)
            for part, key, shape, at in self._layout:
                view = flat[:, at:at + math.prod(shape)].view(capacity, *shape)
                stores[0 if part == "A" else 1][key] = view

    def _grow(self, capacity: int) -> None:
        through_host = self.parks(self.capacity, capacity)
        try:
            self._grow_once(capacity, through_host)
        except BankGrowthError:
            if through_host or not self.capacity:
                raise
            # The card's free memory was counted but not in one piece (the allocator's
            # cache, fragmented): a 0.5B bank of 406 slots failed to take a 27 GiB buffer
            # with 27 GiB free. Through host memory the old rows free theirs first.
            self._grow_once(capacity, True)

    def _grow_once(self, capacity: int, through_host: bool) -> None:
        old = self.capacity
        grown: set[str] = set()
        try:
            # Every view into the old buffers goes first, so that each kind's old buffer is
            # freed as soon as its rows are copied: growing then holds one old kind beside
            # the grown bank, not the whole old bank.
            if old:
                self.flush()
            self._views.clear()
            for kind in (*self.KINDS, "w16"):
                for store in self._stores(kind):
                    store.clear()
            self._flat.pop("w16", None)  # made again from the masters below
            self._flat.pop("gs", None)  # made again at its next use (`scratch`)
            if through_host:  # not even that fits: through host memory
                self._flat = {k: v.cpu() for k, v in self._flat.items()}
            for kind in self.KINDS:
                # the old rows of this kind are freed here (no local holds the new buffer:
                # a failure further on finds only the bank's buffers to restore from)
                self._flat[kind] = self._regrown(kind, old, capacity)
                grown.add(kind)
            # The compute-dtype copy is one buffer too, in the same layout: a step refreshes
            # an adapter's copy in one kernel, and modules that read one x (q/k/v) find
            # their A's side by side in it (`stacked`).
            self._copy16()
        except BaseException as e:
            self._restore(old, grown, through_host)
            if isinstance(e, torch.OutOfMemoryError):
                raise BankGrowthError(
                    f"out of memory growing a LoRA bank from {old} to {capacity} slots of "
                    f"{self.slot_bytes()} bytes (rank {self.rank}); it stays at {old} "
                    f"slots: {e}") from e
            raise
        self._view_stores(capacity)
        self.free.extend(range(capacity - 1, old - 1, -1))
        self.capacity = capacity

    def _regrown(self, kind: str, old: int, capacity: int) -> torch.Tensor:
        flat = self._zeros(capacity)
        if kind in self._flat:
            flat[:old].copy_(self._flat[kind])
        return flat

    def _copy16(self) -> None:
        self._flat["w16"] = (self._flat["w"] if self.dtype == torch.float32
                             else self._flat["w"].to(self.dtype))

    def _restore(self, old: int, grown: set[str], parked: bool) -> None:
        """After a failed growth: every kind back to its `old` rows on the device (a grown
        kind as a view of its first rows, a parked one copied back), the compute-dtype copy
        made again, the stores' views rebuilt. Where that finds no room either, every kind
        goes through host memory: the device then holds what it held before the growth."""
        self._flat.pop("w16", None)
        try:
            for kind in self.KINDS:
                if kind not in self._flat:  # (a first growth: there were no rows)
                    self._flat[kind] = self._zeros(old)
                elif kind in grown:
                    self._flat[kind] = self._flat[kind][:old]
                elif parked:
                    self._flat[kind] = self._flat[kind].to(self.device)
            self._copy16()
        except torch.OutOfMemoryError:
            self._flat.pop("w16", None)
            self._flat = {k: self._flat[k][:old].cpu() for k in self.KINDS}
            self._flat = {k: v.to(self.device) for k, v in self._flat.items()}
            self._copy16()
        self._views.clear()
        self._view_stores(old)

    def big(self, slots: int) -> bool:
        """A bank on a GPU over BIG_BANK_BYTES: it grows by a quarter, not by doubling."""
        return (torch.device(self.device).type == "cuda"
                and len(self.KINDS) * slots * self.slot_numel * 4 > BIG_BANK_BYTES)

    def parks(self, old: int, capacity: int) -> bool:
        """Whether growing from `old` to `capacity` slots moves the rows through host
        memory first: a big bank whose card has no room for the grown bank beside one
        kind of its old rows. On an 8B model a growth took 36-188 ms on the card and 7-21 s
        through host memory (`bench/bench_bank.py`), in a step every tenant waits for."""
        if not self.big(old):
            return False
        device = torch.device(self.device)
        free, _ = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        row = self.slot_numel * 4
        grown = len(self.KINDS) * (capacity - old) * row + (capacity - old) * row // 2
        # the old compute-dtype copy is already freed; a margin for fragmentation
        return free < grown + old * row + BIG_BANK_BYTES // 2

    def allocate(self) -> int:
        if not self.free:
            # Doubling keeps growth rare; a big bank (GiBs a slot on a 32B model) grows by a
            # quarter instead, so a ninth adapter does not reserve room for sixteen.
            big = self.big(self.capacity)
            self._grow(self._capped(self.capacity + max(4, self.capacity // 4) if big
                                    else max(4, 2 * self.capacity)))
        return self.free.pop()

    def release(self, slot: int) -> None:
        self.zero_slot(slot, weights=True)
        self.changed(slot)
        self.free.append(slot)

    def changed(self, slot: int) -> None:
        """The slot's weights were written: its compute-dtype copy follows at the next use,
        and it gets a new version (KV computed with the old weights is never served)."""
        self.stale.add(slot)
        self.versions[slot] = next(_VERSIONS)

    def refresh(self) -> None:
        """Bring the compute-dtype copy of changed slots up to date with the masters."""
        if self.dtype != torch.float32:
            for slot in self.stale:
                self._flat["w16"][slot].copy_(self._flat["w"][slot])
        self.stale.clear()

    def zero_slot(self, slot: int, weights: bool = False) -> None:
        """Clear the slot's gradients (and with `weights`, everything)."""
        if slot in self.dirty:
            self._flat["gs"][slot].zero_()
            self.dirty.discard(slot)
        for kind in self.KINDS if weights else ("g",):
            self._flat[kind][slot].zero_()

    def scratch(self) -> str:
        """The kind of buffer a backward of the lone path adds gradients to (`mark` the
        slot): "g" itself in fp32; else "gs", one in the compute dtype, zero between steps,
        which `flush` adds to "g". A gradient matmul then writes its product with the sum
        in one kernel (addmm_), as it cannot into a buffer of another dtype: one launch per
        weight, not two."""
        if self.dtype == torch.float32:
            return "g"
        if "gs" not in self._flat:
            self._flat["gs"] = torch.zeros_like(self._flat["w16"])
        return "gs"

    def mark(self, slot: int) -> None:
        """A backward will leave `slot`'s gradients in the scratch (`flush` them)."""
        if self.dtype != torch.float32:
            self.dirty.add(slot)

    def flush(self) -> None:
        """Add the gradients waiting in the scratch (`scratch`) to the fp32 ones: two
        kernels a run of consecutive slots."""
        slots = sorted(self.dirty)
        while slots:
            end = 1
            while end < len(slots) and slots[end] == slots[0] + end:
                end += 1
            rows = slice(slots[0], slots[0] + end)
            self._flat["g"][rows].add_(self._flat["gs"][rows])
            self._flat["gs"][rows].zero_()
            slots = slots[end:]
        self.dirty.clear()

    def part(self, kind: str, part: str, key: str) -> torch.Tensor:
        """Module `key`'s A or B (`part` "A" or "B") of every slot in a kind's buffer."""
        for p, k, shape, at in self._layout:
            if (p, k) == (part, key):
                return self._flat[kind][:, at:at + math.prod(shape)].view(self.capacity, *shape)
        raise KeyError(key)

    def flat(self, slot: int, kind: str) -> torch.Tensor:
        """The slot's whole state of one kind ("w", "g", "m", "v") as one 1-D tensor."""
        if kind == "g" and self.dirty:
            self.flush()
        return self._flat[kind][slot]

    def stacked(self, kind: str, keys: tuple[str, ...]) -> torch.Tensor | None:
        """The A's of `keys` side by side, [capacity, len(keys) * r, in], as a view of the
        kind's buffer ("w16", "g"), or None where they do not sit end to end in the slot
        layout with one input width (q/k/v and gate/up do: `targets` lists them in
        order). Cached until the bank grows."""
        views = self._views.get(("stack", kind, keys))
        if views is None:
            at = {key: (shape, start) for part, key, shape, start in self._layout
                  if part == "A"}
            if not all(k in at and len(at[k][0]) == 2 for k in keys):
                return None
            (r, fin), first = at[keys[0]]
            if any(at[k] != ((r, fin), first + i * r * fin) for i, k in enumerate(keys)):
                return None
            flat = self._flat[kind]
            views = [flat[:, first:first + len(keys) * r * fin].view(self.capacity,
                                                                     len(keys) * r, fin)]
            self._views[("stack", kind, keys)] = views
        return views[0]

    def cached(self, key: tuple, make):
        """`make()` once until the bank grows: views into its buffers (the LoRA layers'
        per-slot views, built once rather than at every module call of every step)."""
        if key not in self._views:
            self._views[key] = [make()]
        return self._views[key][0]

    def tensors(self, slot: int, kind: str) -> list[torch.Tensor]:
        """Views of one slot, in a fixed order: weights "w", grads "g" or moments "m", "v".

        Cached: building hundreds of views costs more host time than the optimizer step."""
        if kind == "g" and self.dirty:
            self.flush()
        views = self._views.get((slot, kind))
        if views is None:
            a, b = self._stores(kind)
            views = [a[k][slot] for k in self.shapes] + [b[k][slot] for k in self.shapes]
            self._views[(slot, kind)] = views
        return views
