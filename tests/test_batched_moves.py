"""Moves between the tiers in batches (Residency._park_coldest, Executor.restore_one): runs
that ask for room at once are made room for by one park of as many adapters as they need,
and runs that start parked are made from their seeds in one restore, not one round trip
each. A turn of 64 runs on a GPU parked one adapter per micro-batch's end before (a 1,000-
run bench at 0.11x the resident figure, ~3 moves a second); the runs still train exactly as
runs that always had room.
"""

from __future__ import annotations

import asyncio

import pytest
from test_residency_tiers import _op, _scores
from test_service import run, service
from test_started_parked import _create_only

from twinkled.core.residency import stored_config
from twinkled.protocol.config import Config
from twinkled.protocol.frames import ParkF
from twinkled.protocol.sizing import GiB, adapter_bytes

BANK = 4  # adapters the GPU bank holds


async def _turn(box, runs: dict[str, int]) -> None:
    """A forward_backward and an optim_step of every run {model: its next seq_id}, all runs
    at once."""
    async def one(i: int, m: str, seq: int) -> None:
        await _op(box, f"t{i}", m, lambda: box.fwdbwd(f"t{i}", m, seq, [5, 7], seed=i))
        await _op(box, f"t{i}", m, lambda: box.optim(f"t{i}", m, seq + 1))

    await asyncio.gather(*(one(i, m, s) for i, (m, s) in enumerate(runs.items())))


def test_runs_asking_at_once_are_made_room_by_one_park_and_one_restore(tiny_dir, tmp_path):
    one = adapter_bytes(Config(model=tiny_dir).model_config, 4)
    tiers = {"adapter_memory_gb": (BANK + 0.5) * one / GiB,
             "host_adapter_memory_gb": (2 * BANK + 0.5) * one * 12 / 20 / GiB}

    async def go(**budgets):
        async with service(tiny_dir, tmp_path / str(bool(budgets)), **budgets) as box:
            first = [await box.create(f"t{i}", seed=100 + i) for i in range(BANK)]
            await _turn(box, dict.fromkeys(first, 1))
            lane = box.svc.lanes.all[0]
            later = [await _create_only(box, f"t{BANK + i}", 200 + i) for i in range(BANK)]
            parks, restores = [], []
            moves, restore = lane.executor.moves, lane.executor.restorer.restore

            async def moves_seen(frames, overlap=False):
                parks.append(sum(isinstance(f, ParkF) for f in frames))
                return await moves(frames, overlap)

            async def restore_seen(adapters):
                restores.append(len(adapters))
                return await restore(adapters)

            lane.executor.moves = moves_seen
            lane.executor.restorer.restore = restore_seen
            charged, charge = [], lane.planner.charge

            def charge_seen(tenant, seconds):
                charged.append(tenant)
                return charge(tenant, seconds)

            lane.planner.charge = charge_seen
            await asyncio.gather(*(box.svc.ensure_loaded(box.store.runs.get(m))
                                   for m in later))
            status, paid, made = lane.residency.tiers.status(), list(charged), list(restores)
            assert all(lane.residency.is_open(m) for m in later)
            # all at once: the first ones come back from host memory
            await _turn(box, {**dict.fromkeys(first, 3), **dict.fromkeys(later, 1)})
            return parks, made, status, paid, [
                *await _scores(box, first, 5), *await _scores(box, later, 3, [
                    f"t{BANK + i}" for i in range(BANK)])]

    parks, restores, status, paid, tiered = run(go(**tiers))
    _, _, _, _, alone = run(go())  # (the same runs with room for all: the reference)
    assert status["started_parked"] == BANK and status["moves"] == {"to_host": BANK}, status
    # The first asked alone; the three that asked while its park ran went in one park, and
    # those that asked while a restore ran were made together (one by one: [1, 1, 1, 1])
    assert parks[:2] == [1, BANK - 1], parks
    assert sum(restores) == BANK and len(restores) < BANK, restores
    # Each waiting tenant paid its share of the park that made its room, and its restore
    # (one park charged to the first alone: t5 twice, t6 and t7 once)
    assert all(paid.count(f"t{BANK + i}") == 2 for i in range(BANK)), paid
    # (fp32 tolerance: runs that ask at once are co-batched otherwise with room for all)
    flat = [x for rows in tiered for row in rows for x in row]
    assert flat == pytest.approx([x for rows in alone for row in rows for x in row], rel=1e-5)


def test_a_restore_whose_asker_went_away_costs_the_others_nothing(tiny_dir, tmp_path):
    """Restores asked for together run in the executor's own task: the request that started
    them going away (its task cancelled) neither stops them nor fails the others."""
    one = adapter_bytes(Config(model=tiny_dir).model_config, 4)

    async def go():
        async with service(tiny_dir, tmp_path, adapter_memory_gb=1.5 * one / GiB) as box:
            runs = [await _create_only(box, f"t{i}", 300 + i) for i in range(3)]
            lane = box.svc.lanes.all[0]
            born = [m for m in runs if not lane.residency.is_open(m)]  # (no room: parked)
            assert len(born) == 2
            restore, going = lane.executor.restorer.restore, asyncio.Event()

            async def slow(adapters):  # the first restore waits until told to go on
                await going.wait()
                return await restore(adapters)

            lane.executor.restorer.restore = slow
            async with lane.executor._lock:  # (the group busy: both ask meanwhile)
                first, second = (asyncio.ensure_future(lane.executor.restore_one(
                    m, stored_config(box.store.runs.get(m)))) for m in born)
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.05)  # (both restoring, together)
            first.cancel()  # the asker of the first went away
            going.set()
            moved = await second
            return first.cancelled(), moved.error

    cancelled, error = run(go())
    assert cancelled and error is None


def test_a_park_whose_asker_went_away_is_finished_and_its_adapters_train_on(tiny_dir,
                                                                          tmp_path):
    """A park runs in a task of its own: the request that started it going away (its task
    cancelled mid-park) leaves no adapter half-parked (its queue closed, its state nowhere
    said), and the next request for room is served."""
    one = adapter_bytes(Config(model=tiny_dir).model_config, 4)

    async def go():
        async with service(tiny_dir, tmp_path, adapter_memory_gb=2.5 * one / GiB,
                           host_adapter_memory_gb=4.5 * one * 12 / 20 / GiB) as box:
            first = [await box.create(f"t{i}", seed=400 + i) for i in range(2)]
            await _turn(box, dict.fromkeys(first, 1))
            born = [await _create_only(box, f"t{2 + i}", 500 + i) for i in range(2)]
            lane = box.svc.lanes.all[0]
            moves, entered, going = lane.executor.moves, asyncio.Event(), asyncio.Event()

            async def held(frames, overlap=False):  # the first park waits until told
                entered.set()
                await going.wait()
                return await moves(frames, overlap)

            lane.executor.moves = held
            asker = asyncio.ensure_future(box.svc.ensure_loaded(box.store.runs.get(born[0])))
            await entered.wait()
            other = asyncio.ensure_future(box.svc.ensure_loaded(box.store.runs.get(born[1])))
            await asyncio.sleep(0.05)
            asker.cancel()  # the request went away mid-park
            going.set()
            await other
            served = lane.residency.is_open(born[1])
            tiers = lane.residency.tiers
            parked = [m for m in first if tiers.on_host(m)]
            # every adapter of the first two is somewhere said: in the bank or in host memory
            where = [lane.residency.is_open(m) or tiers.on_host(m) for m in first]
            for i, m in enumerate(first):  # and trains on
                await _op(box, f"t{i}", m, lambda i=i, m=m: box.fwdbwd(f"t{i}", m, 3, [5],
                                                                        seed=i))
            return asker.cancelled(), parked, where, served

    cancelled, parked, where, served = run(go())
    assert cancelled and parked and all(where) and served
