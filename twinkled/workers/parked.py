"""The host tier of adapter residency: adapters moved out of the GPU bank into this
worker's host memory (pinned on CUDA), whole and exactly, so a bank that holds N adapters
serves many more runs (core/tiers.py decides what moves when).

A parked adapter keeps everything it had in the bank: the fp32 master weights and the
optimizer moments (a `Snapshot`, the same flat buffer the disk tier writes, copied on a side
stream on CUDA), the gradients of forward_backwards not yet stepped, and its counts. Coming
back it gets a bank slot again with those bits, so training goes on as if it never left.
Moving on to disk writes the snapshot as a persisted version at the adapter's journal mark
(the last op after which it had no pending gradients): the daemon replays what came after,
as for any persisted state (core/recovery.py).

Under tensor parallelism each rank parks its own slices (no collective); moving on to disk
brings them back into the bank first, where the usual persist gathers them whole.

Host memory dies with the worker: after a restart the daemon treats every adapter that was
parked here as parked on disk (its persisted state and its journal bring it back).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from twinkled.engine import Engine
from twinkled.engine.host_arena import ALIGN, HostArena, Piece
from twinkled.engine.live import unflatten
from twinkled.engine.pinned import pinned_bytes
from twinkled.engine.state import MOMENTS, Snapshot, snapshot, to_device, write_into
from twinkled.protocol.errors import HOST_ROOM
from twinkled.protocol.sizing import human_size
from twinkled.protocol.types import AdapterInfo, EngineInputError


@dataclass
class Parked:
    snap: Snapshot  # weights (and a training adapter's moments), as the disk tier holds them
    grads: torch.Tensor | None  # the bank row of pending gradients (None: it had none)
    pending: int  # datums whose gradients those are
    grads_copied: torch.cuda.Event | None = None  # their copy to the host is done (CUDA)
    piece: Piece | None = None  # the host arena's piece the snapshot lies in
    gpiece: Piece | None = None  # ... and the one the gradients lie in

    def bytes(self) -> int:
        """The host memory it takes (pinned allocations may be rounded up: pinned.py)."""
        g = 0 if self.grads is None else (
            self.gpiece.size if self.gpiece else pinned_bytes(self.grads.nbytes))
        state = self.piece.size if self.piece else pinned_bytes(self.snap.flat.nbytes)
        return state + g


# Parks whose device copies may wait for their copy to the host: each holds its snapshot's
# flat device copy (211 MB of a 0.5B run) until then, so past this many the oldest is waited
# for. Not waiting keeps a park inside a step in flight off that step's critical path.
COPYING = 4


class HostTier:
    def __init__(self, engine: Engine, max_bytes: int | None = None,
                 exact_pending: bool = True):
        """`max_bytes`: what this worker's parked adapters may take of its host memory (the
        daemon's `host_adapter_memory_gb`). The daemon counts 12 bytes a parameter; this
        counts what a park holds (16 for a run with gradients pending; pieces of the arena
        aligned to 4 KiB, or without one pinned allocations a build may round up), so a park
        past it is refused (the daemon then makes room) instead of the kernel killing the
        worker for want of memory.
        `exact_pending`: an adapter with no pending datums has no gradients (not so on a
        context-parallel rank: its share of a split row adds gradients its count leaves
        out, so there the gradients themselves are looked at)."""
        self.engine = engine
        self.max_bytes = max_bytes
        self.exact_pending = exact_pending
        self._parked: dict[str, Parked] = {}
        self._copying: list[Snapshot] = []  # parked, their device copies not yet let go
        # Host memory for the snapshots, on a GPU pinned once from the start (host_arena.py:
        # page-locking in a park cost 240 ms of the step in flight; under tensor parallelism
        # each rank holds its slices, so its share is made ahead); on a CPU made as needed.
        cuda = engine.model.device.type == "cuda"
        self.arena = HostArena(max_bytes, pin=cuda, ahead=max_bytes // engine.model.tp.size
                               if cuda else 0, device=engine.model.device) if max_bytes else None

    def settle(self, wait: bool = False) -> None:
        """Let go of the device copies of parks whose copy to the host has finished (with
        `wait`, of every one, waiting for them)."""
        if wait:
            for snap in self._copying:
                snap.host()
            self._copying = []
        self._copying = [s for s in self._copying if not s.copied()]
        while len(self._copying) > COPYING:
            self._copying.pop(0).host()

    def __contains__(self, adapter_id: str) -> bool:
        return adapter_id in self._parked

    def __len__(self) -> int:
        return len(self._parked)

    def bytes(self) -> int:
        return sum(p.bytes() for p in self._parked.values())

    def oldest(self) -> str | None:
        """The adapter parked longest ago."""
        return next(iter(self._parked), None)

    def park(self, adapter_id: str, training: bool = True) -> None:
        """The adapter out of the bank into host memory (its slot is freed); a sampler's
        (not `training`) weights only."""
        adapter = self.engine.pool.get(adapter_id)
        # Its gradients only if it has any: a run parked between its optimizer steps (the
        # usual case: its turn ended with one) has none, and its host copy is then 12 bytes
        # a parameter, not 16.
        g = adapter.bank.flat(adapter.slot, "g") if training else None
        keep = g is not None and (adapter.pending > 0
                                  or (not self.exact_pending and bool(g.any())))
        need = self._bytes_of(adapter, training, keep)
        if self.max_bytes is not None and self.bytes() + need > self.max_bytes:
            self._refuse(adapter_id, need)
        piece, gpiece = self._pieces(adapter_id, adapter, training, g if keep else None, need)
        # This rank's own slices (under tensor parallelism each rank parks its part, no
        # collective); they go back into the same rank's bank as they are.
        snap = snapshot(adapter, optimizer=training, into=piece and piece.tensor)
        grads, copied = None, None
        if keep:
            grads = (gpiece.tensor.view(g.dtype)[:g.numel()].view(g.shape) if gpiece else
                     torch.empty(g.shape, dtype=g.dtype, pin_memory=g.is_cuda))
            # Ordered before the slot is zeroed on release (same stream).
            grads.copy_(g, non_blocking=g.is_cuda)
            if g.is_cuda:
                copied = torch.cuda.Event()
                copied.record()
        # Until its copy to the host is done the snapshot keeps its device copy
        # (state.Snapshot): let go of by `settle`, never held by a parked adapter (a
        # 1,000-run bench filled the card with 300 parked runs' copies, and its next step
        # ran out of memory).
        self._copying.append(snap)
        self.settle()
        self._parked[adapter_id] = Parked(snap, grads, adapter.pending, copied, piece, gpiece)
        self.engine.remove_adapter(adapter_id)

    def _pieces(self, adapter_id: str, adapter, training: bool, g: torch.Tensor | None,
                need: int) -> tuple[Piece | None, Piece | None]:
        """The arena's pieces for `adapter`'s snapshot and its gradients `g` (None: none
        kept); none without an arena. All it parks lies in the arena, so the worker pins no
        more than its budget. Refused where they do not fit (the daemon makes room, or
        parks it on disk)."""
        if self.arena is None:
            return None, None
        state = self._state_bytes(adapter, training)
        if state > self.arena.chunk:  # (no HOST_ROOM: making room would not help)
            raise EngineInputError("adapter_id", (
                f"adapter {adapter_id!r} needs {human_size(state)} of host memory in one "
                f"piece, more than the host tier's chunks ({human_size(self.arena.chunk)})"))
        piece = self.arena.take(state)
        gpiece = None if piece is None or g is None else self.arena.take(g.nbytes)
        if piece is None or (g is not None and gpiece is None):
            if piece is not None:
                self.arena.give(piece)
            self._refuse(adapter_id, need)  # (lent out, or in pieces too small for these)
        return piece, gpiece

    def _refuse(self, adapter_id: str, need: int) -> None:
        raise EngineInputError("host_adapter_memory_gb", (
            f"{HOST_ROOM} for adapter {adapter_id!r}: it needs {human_size(need)}, "
            f"{human_size(self.bytes())} of {human_size(self.max_bytes)} are taken"))

    @staticmethod
    def _state_bytes(adapter, training: bool) -> int:
        """The bytes of `adapter`'s snapshot: its weights, and a training adapter's
        moments, in one buffer (fp32, as are the gradients)."""
        w = adapter.bank.flat(adapter.slot, "w")
        kinds = 1 + (len(MOMENTS[adapter.config.optimizer]) if training else 0)
        return w.element_size() * kinds * w.numel()

    def _bytes_of(self, adapter, training: bool, grads: bool) -> int:
        """What parking `adapter` takes of host memory: its snapshot and its gradients
        (`grads`), each a piece of the arena, or else a pinned allocation."""
        def size(nbytes: int) -> int:
            return -(-nbytes // ALIGN) * ALIGN if self.arena else pinned_bytes(nbytes)

        g = adapter.bank.flat(adapter.slot, "w").nbytes if grads else 0
        return size(self._state_bytes(adapter, training)) + (size(g) if grads else 0)

    def unpark(self, adapter_id: str, grow: bool = True) -> AdapterInfo:
        """The adapter back into a bank slot, bit for bit as it was parked. On a GPU its
        state is copied in on a side stream (`state.to_device`): sent inside a training step
        in flight (a prefetch), the copy overlaps that step's kernels. `grow` False: only
        into a free slot of a bank that exists (no buffer of the step in flight moves)."""
        self.settle()
        p = self._parked.get(adapter_id)
        if p is None:
            raise EngineInputError("adapter_id", f"adapter {adapter_id!r} is not parked in "
                                   "this worker's memory")
        if not grow and not self.engine.pool.has_slot(p.snap.config):
            raise EngineInputError("adapter_id", "no free bank slot inside a step in flight")
        adapter = self.engine.pool.add(adapter_id, p.snap.config, init=False)  # (written next)
        device = adapter.bank.device
        weights, moments = unflatten(p.snap.names, to_device(p.snap.host(), device),
                                     p.snap.config)
        try:
            with torch.no_grad():
                write_into(adapter, weights, moments, p.snap.steps)
                if p.grads is not None:
                    if p.grads_copied is not None:  # (the copy in reads what that one wrote)
                        p.grads_copied.synchronize()
                    adapter.bank.flat(adapter.slot, "g").copy_(to_device(p.grads, device))
        except BaseException:
            self.engine.remove_adapter(adapter_id)
            raise
        adapter.pending = p.pending
        # (pop: a sampler parked to make its room may have pushed it out of host memory)
        self._parked.pop(adapter_id, None)
        self._give_back(p, copies_on=device)
        return self.engine.adapter_info(adapter_id)

    def take(self, adapter_id: str) -> Snapshot:
        """The parked adapter's snapshot, for the disk; it leaves host memory. (Not a split
        adapter's: its slices are written whole from the bank, `StepRunner`.) Out of the
        arena first: the writer thread keeps it until it is on disk."""
        p = self._parked.pop(adapter_id)
        snap = p.snap if p.piece is None else replace(
            p.snap, flat=p.snap.host().clone(), ready=None, _device_copy=None)
        self._give_back(p)
        return snap

    def drop(self, adapter_id: str) -> None:
        p = self._parked.pop(adapter_id, None)
        if p is not None:
            self._give_back(p)

    def _give_back(self, p: Parked, copies_on: torch.device | None = None) -> None:
        """`p`'s arena pieces back, once no copy reads or writes them: their copies to the
        host (`snap.ready`, `grads_copied`), and the copies of an unpark just queued on
        `copies_on`'s compute stream (which waited for the side stream's)."""
        after, grads_after = p.snap.ready, p.grads_copied
        if copies_on is not None and copies_on.type == "cuda":
            after = grads_after = torch.cuda.current_stream(copies_on).record_event()
        if p.piece is not None:
            self.arena.give(p.piece, after)
        if p.gpiece is not None:
            self.arena.give(p.gpiece, grads_after)
