"""The host arena (engine/host_arena.py): pinned memory made once, ahead of need, lent out
in contiguous pieces and joined again when given back, never past its budget. On the CPU
its chunks are ordinary memory (`pin=False`); the pinned path, and the host tier parking into
it, run on a GPU (tests/test_host_memory.py, `gpucheck`)."""

from __future__ import annotations

import torch

from twinkled.engine.host_arena import ALIGN, HostArena

MiB = 2**20


def test_pieces_are_disjoint_and_join_their_neighbours_when_given_back():
    arena = HostArena(4 * MiB, pin=False, ahead=0, chunk=4 * MiB)
    a, b, c = (arena.take(MiB) for _ in range(3))
    assert arena.made() == 4 * MiB and arena.free_bytes() == MiB
    spans = sorted((p.tensor.data_ptr(), p.tensor.data_ptr() + p.tensor.nbytes) for p in (a, b, c))
    assert all(x[1] <= y[0] for x, y in zip(spans, spans[1:], strict=False))  # no two overlap
    a.tensor.fill_(1)
    c.tensor.fill_(3)
    b.tensor.fill_(2)
    assert a.tensor.eq(1).all() and c.tensor.eq(3).all()
    assert arena.take(2 * MiB) is None  # 1 MiB free, and no budget for another chunk
    arena.give(b)
    assert arena.take(2 * MiB) is None  # two free MiBs, but apart
    arena.give(a)  # a and b join: 2 MiB in one range
    two = arena.take(2 * MiB)
    assert two is not None and arena.free_bytes() == MiB
    arena.give(two)
    arena.give(c)
    assert arena.take(4 * MiB) is not None  # all joined again: the whole chunk


def test_sizes_are_aligned_and_a_piece_larger_than_a_chunk_is_not_lent():
    arena = HostArena(2 * MiB, pin=False, ahead=0, chunk=MiB)
    p = arena.take(1000)
    assert p.size == ALIGN and p.tensor.nbytes == ALIGN
    assert p.tensor.view(torch.float32).numel() == ALIGN // 4
    assert arena.take(MiB + 1) is None  # (the host tier allocates such a one itself)


def test_the_budget_is_made_ahead_on_a_thread_and_never_passed():
    arena = HostArena(3 * MiB, pin=False, chunk=MiB)  # ahead: all of it
    assert arena.wait_filled(30)
    assert arena.made() == 3 * MiB
    taken = [arena.take(MiB) for _ in range(3)]
    assert all(taken) and arena.made() == 3 * MiB  # (made before, none now)
    assert arena.take(ALIGN) is None  # the budget is spent
    arena.give(taken[1])
    assert arena.take(MiB) is not None


def test_chunks_past_what_was_made_ahead_are_made_when_needed_within_the_budget():
    arena = HostArena(3 * MiB, pin=False, ahead=MiB, chunk=MiB)
    assert arena.wait_filled(30) and arena.made() == MiB
    assert arena.take(MiB) is not None and arena.take(MiB) is not None
    assert arena.made() == 2 * MiB
    assert arena.take(MiB) is not None and arena.take(MiB) is None
    assert arena.made() == 3 * MiB


def test_no_chunk_is_larger_than_the_budgets_largest_power_of_two():
    """(So a piece that could never fit is refused as larger than a chunk, and the host tier
    parks it on disk at once, not after spilling every other parked adapter.)"""
    arena = HostArena(3 * MiB, pin=False, ahead=0)
    assert arena.chunk == 2 * MiB
    assert arena.take(2 * MiB + 1) is None and arena.made() == 0
    assert arena.take(2 * MiB) is not None and arena.take(MiB) is not None
    assert arena.made() == 3 * MiB
