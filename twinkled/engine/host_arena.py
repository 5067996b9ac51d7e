"""Page-locked host memory made once, ahead of need, and lent out in pieces: where the host
tier (workers/parked.py) keeps parked adapters' states.

Page-locking is slow: on an H200 machine a fresh pinned allocation of a 0.5B adapter's state
took 317 ms (0.9 GB/s), and a park into fresh memory 239 ms against 13 ms into memory an
unpark had freed (BENCHMARKS.md, session 22). A park runs on the worker's thread, inside the
training step in flight, so a host tier filling from empty stretched a 1,000-run bench's
steps from 0.4 s to 2.3 s. The arena pins its budget in chunks on a thread of its own from
the start (as vLLM pins its CPU swap space at start) and lends contiguous pieces of them
(first fit, neighbours joined when given back), so no park page-locks. Chunks are powers of
two, so a torch build that rounds pinned allocations up (2.11) wastes nothing.

A piece given back while a copy may still read or write it (a park's copy to the host, an
unpark's to the device) is held until that copy's event has completed.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time

import torch

from twinkled.protocol.sizing import human_size

log = logging.getLogger("twinkled")

ALIGN = 4096  # a piece's start and size (fp32 views of it stay aligned)
CHUNK_MAX = 4 * 2**30  # bytes of one chunk (one pinned allocation), at most
CHUNK_MIN = 64 * 2**10  # the budget's last bytes below this are not made


class Piece:
    """A piece of a chunk, lent out: `tensor` is its bytes (uint8)."""

    def __init__(self, chunk: int, start: int, size: int, tensor: torch.Tensor):
        self.chunk, self.start, self.size, self.tensor = chunk, start, size, tensor


class HostArena:
    def __init__(self, budget: int, pin: bool = True, ahead: int | None = None,
                 chunk: int | None = None, device: torch.device | None = None):
        """`budget`: bytes of chunks in all; `pin`: page-locked (CUDA); `ahead`: bytes of
        chunks made from the start on a thread of their own (default all of `budget`; more
        are made when a piece does not fit, while the budget lasts); `chunk`: the largest
        chunk (CHUNK_MAX, or the budget's largest power of two); the budget's last ones are
        smaller powers of two, so that the chunks add up to the budget (its binary
        digits)."""
        self.chunk = min(chunk or CHUNK_MAX, 1 << (max(budget, 1).bit_length() - 1))
        self.budget, self.pin = budget, pin
        # (the CUDA device is a thread's own: the filler's is the worker's, or its first
        # pinned allocation would make a context on GPU 0, ~500 MB of another lane's card)
        self._device = device
        self._chunks: list[torch.Tensor] = []
        self._free: list[list[tuple[int, int]]] = []  # per chunk: sorted (start, end)
        self._held: list[tuple[Piece, torch.cuda.Event | None]] = []  # given back, in use
        self._lock = threading.Lock()  # (the filler appends chunks; the rest is one thread)
        self._reserved = 0  # bytes of chunks made or being made
        ahead = budget if ahead is None else min(ahead, budget)
        self._filler = None
        if ahead >= CHUNK_MIN:
            self._filler = threading.Thread(target=self._fill, args=(ahead,),
                                            name="host-arena", daemon=True)
            self._filler.start()

    def made(self) -> int:
        """Bytes of chunks made."""
        with self._lock:
            return sum(c.nbytes for c in self._chunks)

    def free_bytes(self) -> int:
        self._settle()
        return sum(e - s for ranges in self._free for s, e in ranges)

    def wait_filled(self, timeout: float | None = None) -> bool:
        """Wait for the chunks made ahead (tests, benches); whether they all are."""
        if self._filler is not None:
            self._filler.join(timeout)
            return not self._filler.is_alive()
        return True

    def take(self, nbytes: int) -> Piece | None:
        """A piece of at least `nbytes`; None if none fits and the budget has no room for
        another chunk (or `nbytes` is more than a chunk)."""
        size = -(-nbytes // ALIGN) * ALIGN
        if size > self.chunk:
            return None
        self._settle()
        piece = self._first_fit(size)
        while piece is None and self._filler is not None and self._filler.is_alive():
            self._filler.join(0.05)  # its next chunk is coming: a second one made here
            piece = self._first_fit(size)  # would take as long again, the budget beside
        if piece is None and self._grow():
            piece = self._first_fit(size)
        return piece

    def give(self, piece: Piece, after: torch.cuda.Event | None = None) -> None:
        """`piece` back to the arena, once `after` (a copy reading or writing it) is done."""
        if after is not None and not after.query():
            self._held.append((piece, after))
            return
        self._join(piece)

    # -- inside -------------------------------------------------------------------------

    def _fill(self, ahead: int) -> None:
        if self.pin and self._device is not None and self._device.index is not None:
            torch.cuda.set_device(self._device)
        began = time.monotonic()
        while self._reserved < ahead and self._grow():
            pass
        if self.pin:  # (what the operator sized: operator.md 5d)
            log.info("host tier: %s of pinned memory made for parked adapters in %.0f s",
                     human_size(self.made()), time.monotonic() - began)

    def _grow(self) -> bool:
        """One more chunk, if the budget has room for one: the largest, or the largest
        power of two the budget has left."""
        with self._lock:
            left = self.budget - self._reserved
            if left < CHUNK_MIN:
                return False
            size = min(self.chunk, 1 << (left.bit_length() - 1))
            self._reserved += size
        try:
            t = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        except RuntimeError as e:  # (out of host memory: parks beyond go to disk)
            log.warning("could not pin %d MiB of host memory for parked adapters: %s",
                        size >> 20, e)
            with self._lock:
                self._reserved -= size
            return False
        with self._lock:
            self._chunks.append(t)
            self._free.append([(0, size)])
        return True

    def _first_fit(self, size: int) -> Piece | None:
        with self._lock:
            for c, ranges in enumerate(self._free):
                for j, (s, e) in enumerate(ranges):
                    if e - s >= size:
                        if e - s == size:
                            del ranges[j]
                        else:
                            ranges[j] = (s + size, e)
                        return Piece(c, s, size, self._chunks[c][s:s + size])
        return None

    def _join(self, piece: Piece) -> None:
        with self._lock:
            ranges = self._free[piece.chunk]
            s, e = piece.start, piece.start + piece.size
            j = bisect.bisect(ranges, (s, e))
            if j < len(ranges) and ranges[j][0] == e:  # the free range after it
                e = ranges.pop(j)[1]
            if j > 0 and ranges[j - 1][1] == s:  # the one before
                s = ranges.pop(j - 1)[0]
                j -= 1
            ranges.insert(j, (s, e))

    def _settle(self) -> None:
        """Pieces given back whose copies have finished are free again."""
        held, self._held = self._held, []
        for piece, event in held:
            if event.query():
                self._join(piece)
            else:
                self._held.append((piece, event))
