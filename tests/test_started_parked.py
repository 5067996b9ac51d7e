"""Runs created while the GPU bank is full start parked on disk with no state
(Residency.start_parked): their weights are made from their seed on their first request, so
they train exactly as runs created with room, even across a daemon restart in between.
"""

from __future__ import annotations

import asyncio

import pytest
from test_residency_tiers import _op, _scores, _train
from test_service import done, run, service

from twinkled.protocol.config import Config
from twinkled.protocol.sizing import GiB, adapter_bytes
from twinkled.protocol.types import LoraConfig

RUNS = 4


async def _create_only(box, tenant: str, seed: int) -> str:
    """A create as a client sends it, without a request after it (unlike `Box.create`)."""
    box.store.tenants.ensure(tenant)
    session = box.store.sessions.create(tenant)
    model, f = box.svc.create_model(tenant, session, None,
                                    LoraConfig(rank=4, alpha=8.0, seed=seed), {}, _answer)
    await done(f)
    assert f.error is None, f.error
    return model


async def _full_bank_and_a_session(box) -> str:
    """The bank (room for one) filled by tenant t0's run; a session of tenant t1's."""
    await _create_only(box, "t0", 1)
    box.store.tenants.ensure("t1")
    return box.store.sessions.create("t1")


def _answer(_model: str) -> tuple[bytes, str]:
    return b"{}", "application/json"


def test_runs_started_parked_train_as_runs_created_with_room_across_a_restart(tiny_dir,
                                                                             tmp_path):
    one = adapter_bytes(Config(model=tiny_dir).model_config, 4)
    small = {"adapter_memory_gb": 1.5 * one / GiB,
             "host_adapter_memory_gb": 1.5 * one * 12 / 20 / GiB}

    async def with_room():
        async with service(tiny_dir, tmp_path / "room") as box:
            runs = [await _create_only(box, f"t{i}", 100 + i) for i in range(RUNS)]
            assert box.svc.lanes.all[0].residency.tiers.status()["started_parked"] == 0
            seq = await _train(box, runs, 1, 2)
            return await _scores(box, runs, seq)

    async def started_parked():
        async with service(tiny_dir, tmp_path / "parked", **small) as box:
            runs = [await _create_only(box, f"t{i}", 100 + i) for i in range(RUNS)]
            residency = box.svc.lanes.all[0].residency
            assert residency.count() == 1
            assert residency.tiers.status()["started_parked"] == RUNS - 1
            rows = [box.store.runs.get(m) for m in runs[1:]]
            assert all(r["idle_unloaded"] and not r["live"] and r["next_seq"] == 1
                       for r in rows)
        # The daemon stops before any of them trained, and starts again: nothing of the
        # started-parked runs was written, and each is made from its seed when it comes in
        async with service(tiny_dir, tmp_path / "parked", **small) as box:
            seq = await _train(box, runs, 1, 2)
            return await _scores(box, runs, seq)

    want, got = run(with_room()), run(started_parked())
    for a, b in zip(want, got, strict=True):
        for x, y in zip(a, b, strict=True):
            assert y == pytest.approx(x, abs=1e-4)


def test_a_create_training_no_module_is_refused_at_the_door_even_with_the_bank_full(tiny_dir,
                                                                                   tmp_path):
    """A run that would start parked is checked as one the bank has room for: a LoRA config
    that trains no module is refused at create, naming the fields, not at its first request."""
    from twinkled.protocol.errors import UserError

    one = adapter_bytes(Config(model=tiny_dir).model_config, 4)

    async def go():
        async with service(tiny_dir, tmp_path, adapter_memory_gb=1.5 * one / GiB) as box:
            session = await _full_bank_and_a_session(box)
            bad = LoraConfig(rank=4, seed=2, train_attn=False, train_mlp=False,
                             train_unembed=False)
            with pytest.raises(UserError, match="train_attn.*train_mlp.*train_unembed"):
                box.svc.create_model("t1", session, None, bad, {}, _answer)
            assert box.svc.lanes.all[0].residency.tiers.status()["started_parked"] == 0
            assert box.store.runs.get(f"{session}:train:0") is None  # nothing recorded

    run(go())


def test_a_retried_create_of_a_run_started_parked_gets_the_original_answer(tiny_dir,
                                                                          tmp_path):
    """A client that lost the answer to its create sends it again (same session, same
    model_seq_id, same config): it gets the original run and answer, as for a run created
    with room, before and after the run came in; not "already exists"."""
    one = adapter_bytes(Config(model=tiny_dir).model_config, 4)

    async def go():
        async with service(tiny_dir, tmp_path, adapter_memory_gb=1.5 * one / GiB) as box:
            session = await _full_bank_and_a_session(box)
            config = LoraConfig(rank=4, alpha=8.0, seed=2)

            def create():
                return box.svc.create_model("t1", session, 0, config, {}, _answer)

            model, f = create()
            await done(f)
            assert box.svc.lanes.all[0].residency.tiers.status()["started_parked"] == 1
            again, g = create()
            assert (again, g.id) == (model, f.id) and g.error is None
            await _op(box, "t1", model, lambda: box.fwdbwd("t1", model, 1, [5, 7]))  # in
            again, g = create()
            assert (again, g.id) == (model, f.id)

    run(go())


def test_a_run_started_parked_on_a_full_lane_comes_in_on_another_as_a_new_run(tiny_dir,
                                                                              tmp_path):
    """Two lanes of one adapter each, both full: a third run starts parked. Once a lane has
    room its first request brings it in there, made from its seed, still not counted as a
    move from disk (the mark goes with it to the other lane)."""
    one = adapter_bytes(Config(model=tiny_dir).model_config, 4)

    async def go():
        async with service(tiny_dir, tmp_path, lanes=2,
                           adapter_memory_gb=1.5 * one / GiB) as box:
            first, second = [await _create_only(box, f"t{i}", i) for i in range(2)]
            third = await _create_only(box, "t2", 2)
            lanes = box.svc.lanes.all
            assert sum(lane.residency.tiers.status()["started_parked"] for lane in lanes) == 1
            home = box.svc.lanes.of(third)
            free = box.svc.lanes.of(first if home is not box.svc.lanes.of(first) else second)
            assert free is not home
            gone = first if free is box.svc.lanes.of(first) else second
            tenant = "t0" if gone == first else "t1"
            box.svc.unload_models(tenant, [gone])  # room on the other lane now
            while free.residency.is_open(gone):
                await asyncio.sleep(0.01)
            await _op(box, "t2", third, lambda: box.fwdbwd("t2", third, 1, [5, 7]))
            assert box.svc.lanes.of(third) is free
            moves = [lane.residency.tiers.status()["moves"] for lane in lanes]
            assert all(m.get("from_disk", 0) == 0 for m in moves), moves

    run(go())
