"""Lanes (twinkled/core/lanes.py): the devices split into independent worker groups, a model on
one of them. In-process lanes here (two engines in this process); a daemon with two lanes
of worker processes, one of them killed, in test_workers.py."""

from __future__ import annotations

import asyncio

from test_service import Box, done, logprobs, result, run, service

from twinkled.core.balance import balance
from twinkled.protocol.config import Config
from twinkled.protocol.frames import SampleF, SamplingF, buf
from twinkled.server.layout import layout_problems


def lane_of(box: Box, model: str) -> int:
    return box.svc.lanes.of(model).index


async def train(box: Box, tenant: str, model: str, rounds: int) -> list[list[float]]:
    """`rounds` of forward_backward + optim_step on the same rows; the last losses."""
    out = []
    for r in range(rounds):
        f = box.fwdbwd(tenant, model, 1 + 2 * r, [6, 4], seed=11)
        o = box.optim(tenant, model, 2 + 2 * r)
        await done(f, o)
        assert f.error is None and o.error is None, (f.error, o.error)
        out = logprobs(result(f))
    return out


def test_models_spread_over_lanes_and_train_as_on_one(tiny_dir, tmp_path):
    async def two_lanes():
        async with service(tiny_dir, tmp_path / "two", lanes=2) as box:
            a, b = await box.create("alice", seed=1), await box.create("bob", seed=2)
            assert {lane_of(box, a), lane_of(box, b)} == {0, 1}  # one each
            got = await asyncio.gather(train(box, "alice", a, 3), train(box, "bob", b, 3))
            steps = [lane.planner.steps for lane in box.svc.lanes.all]
            status = box.svc.life.status()
            return got, steps, status

    async def one_lane():
        async with service(tiny_dir, tmp_path / "one") as box:
            a, b = await box.create("alice", seed=1), await box.create("bob", seed=2)
            return await asyncio.gather(train(box, "alice", a, 3), train(box, "bob", b, 3))

    (got, steps, status), want = run(two_lanes()), run(one_lane())
    assert all(n >= 4 for n in steps), steps  # each lane stepped its own model
    for x, y in zip(got, want, strict=True):  # the same weights as on one worker group
        for p, q in zip(x, y, strict=True):
            assert max(abs(u - v) for u, v in zip(p, q, strict=True)) < 1e-4
    assert status["adapters"] == 2 and [ln["adapters"] for ln in status["lanes"]] == [1, 1]
    assert sorted(w["lane"] for w in status["workers"]) == [0, 1]
    assert status["tenants"]["alice"]["served_tokens"] > 0 and \
        status["tenants"]["bob"]["served_tokens"] > 0


def test_a_failing_lane_fails_only_its_own_steps(tiny_dir, tmp_path):
    async def go():
        async with service(tiny_dir, tmp_path, lanes=2) as box:
            a, b = await box.create("alice"), await box.create("bob")
            broken = box.svc.lanes.of(b)
            real = broken.executor.run_ops

            async def fails(kind, ops, micro_tokens=0):
                raise RuntimeError("lane on fire")

            broken.executor.run_ops = fails
            fa, fb = box.fwdbwd("alice", a, 1, [5]), box.fwdbwd("bob", b, 1, [5])
            await done(fa, fb)
            broken.executor.run_ops = real
            again = box.fwdbwd("bob", b, 2, [5])
            await done(again)
            return fa.error, fb.error, again.error

    ok, failed, again = run(go())
    assert ok is None and "lane on fire" in failed[0] and again is None


def test_sampling_runs_on_the_lane_of_the_run_that_saved_it(tiny_dir, tmp_path):
    async def go():
        async with service(tiny_dir, tmp_path, lanes=2) as box:
            a, b = await box.create("alice"), await box.create("bob")
            run_b = box.store.runs.get(b)
            saved = box.svc.save_for_sampler("bob", run_b, 1, None, user_metadata={},
                                             ttl_s=None, answer=lambda s: (s.encode(), "x"))
            await done(saved)
            assert saved.error is None, saved.error
            path = f"tinker://{b}/sampler_weights/ephemeral-1"
            sampler = box.store.samplers.get(saved.payload.decode())
            ck = box.store.checkpoints.get(path)
            adapter = f"sampler:{path}@{ck['sha256'][:16]}"
            frame = SampleF(adapter, buf([1, 2, 3], "int64"),
                            SamplingF(4, 1.0, -1, 1.0, 7, None), 1, load_from=ck["dir"])
            lane = box.svc.lanes.for_sample(adapter)
            before = lane.planner.steps
            f = box.svc.sample("bob", sampler, frame, box.keep)
            await done(f)
            return f.error, lane.index, lane_of(box, b), lane.planner.steps - before, a

    error, lane, home, steps, _ = run(go())
    assert error is None and lane == home and steps >= 1


def test_restart_brings_every_model_back_on_some_lane(tiny_dir, tmp_path):
    async def first():
        async with service(tiny_dir, tmp_path, lanes=2) as box:
            models = [await box.create(t) for t in ("ann", "ben", "cat")]
            for m, t in zip(models, ("ann", "ben", "cat"), strict=True):
                await train(box, t, m, 1)
            return models, box.sessions

    async def second(models):
        async with service(tiny_dir, tmp_path, lanes=2) as box:
            lanes = [lane_of(box, m) for m in models]
            open_ = [box.svc.lanes.of(m).residency.is_open(m) for m in models]
            f = box.fwdbwd("ann", models[0], 3, [6, 4], seed=11)
            await done(f)
            return lanes, open_, f.error

    models, _ = run(first())
    lanes, open_, error = run(second(models))
    assert all(open_) and sorted(set(lanes)) == [0, 1] and error is None


def test_layout_names_lanes_that_do_not_divide_the_devices(tiny_dir, tmp_path):
    cfg = Config(model=tiny_dir, data_dir=tmp_path, devices=["cpu"] * 3, lanes=2)
    assert any("lanes: 2 does not divide the 3" in p for p in layout_problems(cfg))
    cfg = Config(model=tiny_dir, data_dir=tmp_path, devices=["cpu"] * 4, lanes=2)
    assert cfg.lane_devices() == [["cpu", "cpu"], ["cpu", "cpu"]]
    assert not any(p.startswith("lanes") for p in layout_problems(cfg))
    cfg = Config(model=tiny_dir, data_dir=tmp_path, devices=["cpu"] * 2, lanes=2,
                 remote_ranks=2)
    assert any("takes no other hosts" in p for p in layout_problems(cfg))


def test_a_checkpoint_saved_on_one_lane_loads_on_another(tiny_dir, tmp_path):
    """create_from_checkpoint places the new run anew (the lane with fewest models): the
    state saved by a run on lane 0 is read by a run on lane 1, same weights."""
    async def go():
        async with service(tiny_dir, tmp_path, lanes=2) as box:
            svc = box.svc
            a = await box.create("alice")
            await train(box, "alice", a, 2)
            saved = svc.save("alice", box.store.runs.get(a), 5, "weights", "w", optimizer=True,
                             user_metadata={}, ttl_s=None, overwrite=False,
                             answer=lambda path: (path.encode(), "text/plain"))
            await done(saved)
            assert saved.error is None, saved.error
            ck = box.store.checkpoints.get(f"tinker://{a}/weights/w")
            b, f = svc.create_from_checkpoint("alice", box.sessions["alice"], None, ck, True,
                                              "adamw", {}, lambda m: (m.encode(), "text/plain"))
            await done(f)
            assert f.error is None, f.error
            x = box.fwdbwd("alice", a, 6, [6, 4], seed=11, forward_only=True)
            y = box.fwdbwd("alice", b, 1, [6, 4], seed=11, forward_only=True)
            await done(x, y)
            return lane_of(box, a), lane_of(box, b), logprobs(result(x)), logprobs(result(y))

    la, lb, x, y = run(go())
    assert (la, lb) == (0, 1)
    for p, q in zip(x, y, strict=True):
        assert max(abs(u - v) for u, v in zip(p, q, strict=True)) < 1e-5
    cfg = Config(model=tiny_dir, data_dir=tmp_path, devices=["cpu"] * 4, lanes=2, ep=4)
    assert "ep: --ep 4 must divide each lane's 2 worker ranks" in layout_problems(cfg)


def _served_on_two_lanes(ledger) -> dict[tuple[int, str], int]:
    """Tenant a with a run on each of two lanes, b with one on lane 1, all flooding; the
    lanes step in turn. Tokens served per (lane, tenant)."""
    from test_scheduler import flood

    from scheduler import Planner

    lanes = [Planner(token_budget=1024, target_step_s=0, ledger=ledger()) for _ in range(2)]
    flood(lanes[0], "a", "a0", 300)
    flood(lanes[1], "a", "a1", 300)
    flood(lanes[1], "b", "b1", 300)
    served: dict[tuple[int, str], int] = {}
    for _ in range(100):
        for i, p in enumerate(lanes):
            step = p.next_step()
            p.complete(step)
            for w in step.work:
                served[i, w.tenant] = served.get((i, w.tenant), 0) + w.tokens
    return served


def test_a_tenant_with_runs_on_two_lanes_gets_its_fair_share_once_not_twice():
    """The lanes' planners share one ledger of virtual times (scheduler/fairness.py): a
    tenant served on lane 0 is as far along on lane 1, where the tenant that has only lane
    1 then goes first. Over the node both get about the same; with a clock per lane, a
    got lane 0 and half of lane 1 (three times b's share)."""
    from scheduler import Ledger

    shared = Ledger()
    served = _served_on_two_lanes(lambda: shared)
    a = served[0, "a"] + served.get((1, "a"), 0)
    b = served[1, "b"]
    assert abs(a - b) / (a + b) < 0.05, served
    apart = _served_on_two_lanes(Ledger)  # what a clock per lane gives
    assert apart[0, "a"] + apart[1, "a"] > 2.5 * apart[1, "b"], apart


async def _rounds(box: Box, tenant: str, model: str, seq: int, rounds: int,
                  pending: bool = False) -> int:
    """`rounds` of forward_backward + optim_step (and one forward_backward left pending);
    the next seq_id."""
    for r in range(rounds):
        f = box.fwdbwd(tenant, model, seq, [6, 4], seed=seq + r)
        o = box.optim(tenant, model, seq + 1)
        await done(f, o)
        assert f.error is None and o.error is None, (f.error, o.error)
        seq += 2
    if pending:
        f = box.fwdbwd(tenant, model, seq, [5], seed=seq)
        await done(f)
        assert f.error is None, f.error
        seq += 1
    return seq


async def _score(box: Box, tenant: str, model: str, seq: int) -> list[list[float]]:
    await box.svc.ensure_loaded(box.store.runs.get(model))  # as a route does
    f = box.fwdbwd(tenant, model, seq, [7], seed=99, forward_only=True)
    await done(f)
    assert f.error is None, f.error
    return logprobs(result(f))


def test_a_run_moved_to_a_less_loaded_lane_trains_on_where_it_left_off(tiny_dir, tmp_path):
    """Lanes in balance (core/balance.py): two runs on lane 0, none left on lane 1 (its
    runs' session ended); balancing moves the idle one of lane 0 used least recently to lane
    1, with its optimizer moments and a forward_backward's gradients still pending, and it
    trains on there to the weights it reaches never moved (fp32 tolerance)."""
    async def go(lanes: int):
        async with service(tiny_dir, tmp_path / str(lanes), lanes=lanes) as box:
            runs = {t: await box.create(t, seed=s) for t, s in (("a", 1), ("b", 2), ("c", 3),
                                                                ("d", 4))}
            seq = {t: await _rounds(box, t, m, 1, 2, pending=t in "ac")
                   for t, m in runs.items()}
            moved = None
            if lanes == 2:
                assert [lane_of(box, runs[t]) for t in "abcd"] == [0, 1, 0, 1]
                box.svc.unload_models("b", [runs["b"]])
                box.svc.unload_models("d", [runs["d"]])
                while box.svc.lanes.all[1].residency.count():
                    await asyncio.sleep(0.01)
                assert await balance(box.svc.lanes) == 1
                moved = [t for t in "ac" if lane_of(box, runs[t]) == 1]
                status = box.svc.life.status()
                assert status["lane_moves"] == 1 and [ln["load"] for ln in status["lanes"]] \
                    == [1, 1]
            for t in "ac":
                seq[t] = await _rounds(box, t, runs[t], seq[t], 2)
            return {t: await _score(box, t, runs[t], seq[t]) for t in "ac"}, moved

    (got, moved), (want, _) = run(go(2)), run(go(1))
    assert moved == ["a"]  # the least recently used
    for t in "ac":
        for p, q in zip(got[t], want[t], strict=True):
            assert max(abs(u - v) for u, v in zip(p, q, strict=True)) < 1e-4
