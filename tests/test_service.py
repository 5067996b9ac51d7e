"""The service and its engine core, driven in-process (no subprocesses, no HTTP).

The executor runs the same frames on the same StepRunner as a worker process does, through
`InProcessGroup` (twinkled/workers/inprocess.py), on the tiny model.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import random

import pytest

from twinkled.core.make_executor import in_process_executor
from twinkled.core.service import Service
from twinkled.protocol.config import Config
from twinkled.protocol.errors import UserError
from twinkled.protocol.frames import DatumF, OptimF, TrainF, buf
from twinkled.protocol.types import AdamParams, LoraConfig
from twinkled.store import Store

WAIT = 120.0  # seconds a step may take on a busy CPU


class Box:
    """A service on the tiny model, with helpers that queue ops as the routes do."""

    def __init__(self, svc: Service, store: Store):
        self.svc, self.store = svc, store
        self.sessions: dict[str, str] = {}
        self.vocab = 0

    async def create(self, tenant: str, rank: int = 4, seed: int | None = None) -> str:
        self.store.tenants.ensure(tenant)
        if tenant not in self.sessions:
            self.sessions[tenant] = self.store.sessions.create(tenant)
        seed = random.randrange(1 << 30) if seed is None else seed
        config = LoraConfig(rank=rank, alpha=8.0, seed=seed)
        model, f = self.svc.create_model(tenant, self.sessions[tenant], None, config, {},
                                         lambda model: (b"{}", "application/json"))
        await done(f)
        assert f.error is None, f.error
        # In the bank now, as after a client's first request (a create the bank has no room
        # for starts parked: Residency.start_parked)
        await self.svc.ensure_loaded(self.store.runs.get(model))
        return model

    def fwdbwd(self, tenant: str, model: str, seq: int, lengths: list[int], seed: int = 0,
               forward_only: bool = False):
        gen = random.Random(seed)
        data = []
        for n in lengths:
            toks = [gen.randrange(self.vocab) for _ in range(n + 1)]
            data.append(DatumF(buf(toks[:-1], "int64"),
                               {"target_tokens": buf(toks[1:], "int64"),
                                "weights": buf([1.0] * n, "float32")}))
        frame = TrainF(model, data, "cross_entropy", {}, forward_only)
        return self.svc.forward_backward(tenant, model, seq, frame, self.keep)

    def optim(self, tenant: str, model: str, seq: int, lr: float = 1e-2):
        frame = OptimF(model, AdamParams(learning_rate=lr))
        return self.svc.optim_step(tenant, model, seq, frame, self.keep)

    @staticmethod
    def keep(result) -> tuple[bytes, str]:
        """An encoder that keeps the result itself (`result` reads it back)."""
        return pickle.dumps(result), "application/octet-stream"


def result(f):
    """What future `f` was resolved with."""
    return pickle.loads(f.payload)


async def done(*futures, timeout: float = WAIT) -> None:
    await asyncio.wait_for(asyncio.gather(*(f.done.wait() for f in futures)), timeout)


@contextlib.asynccontextmanager
async def service(tiny_dir, tmp_path, **overrides):
    cfg = Config(model=tiny_dir, data_dir=tmp_path, device="cpu", dtype="float32",
                 **{"gather_ms": 0, "worker_threads": 1, **overrides})
    store = Store(tmp_path / "twinkled.store.db")
    svc = Service(cfg, store, executor=[in_process_executor(cfg) for _ in range(cfg.lanes)])
    await svc.life.start(housekeeping=False)
    await asyncio.wait_for(svc.life.settled(), WAIT)
    assert svc.life.state == "ready", svc.life.error
    box = Box(svc, store)
    box.vocab = svc.model_info["vocab_size"]
    try:
        yield box
    finally:
        if not svc.life.stopping:
            await svc.life.shutdown()
        await svc.life.close()
        store.close()


def refused(store) -> list[str]:
    return [r["status"] for r in store.db.all("SELECT status FROM futures WHERE kind = 'refused'")]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 600))


def logprobs(result) -> list[list[float]]:
    import struct

    out = []
    for o in result.outputs:
        b = o["logprobs"]
        out.append(list(struct.unpack(f"<{len(b.data) // 4}f", b.data)))
    return out


def test_two_tenants_co_batched_in_one_step(tiny_dir, tmp_path):
    async def go():
        async with service(tiny_dir, tmp_path) as box:
            a, b = await box.create("alice"), await box.create("bob")
            steps = box.svc.lanes.all[0].planner.steps
            fa = box.fwdbwd("alice", a, 1, [5, 7], seed=1)
            fb = box.fwdbwd("bob", b, 1, [6], seed=2)
            await done(fa, fb)
            assert fa.error is None and fb.error is None
            assert box.svc.lanes.all[0].planner.steps == steps + 1  # one step held both tenants' rows
            ra, rb = result(fa), result(fb)
            assert [len(x) for x in logprobs(ra)] == [5, 7]
            assert [len(x) for x in logprobs(rb)] == [6]
            # Alone, alice's rows give the same logprobs: co-batching changed nothing.
            alone = box.fwdbwd("alice", a, 2, [5, 7], seed=1, forward_only=True)
            await done(alone)
            for x, y in zip(logprobs(ra), logprobs(result(alone)), strict=True):
                assert max(abs(p - q) for p, q in zip(x, y, strict=True)) < 1e-4

    run(go())


def test_ops_run_in_seq_id_order_whatever_order_they_arrive(tiny_dir, tmp_path):
    async def go():
        async with service(tiny_dir, tmp_path) as box:
            m = await box.create("alice")
            f2 = box.optim("alice", m, 2)
            await asyncio.sleep(0.3)
            assert not f2.done.is_set()  # waits for seq_id 1
            f1 = box.fwdbwd("alice", m, 1, [4], seed=3)
            await done(f1, f2)
            assert f1.error is None and f2.error is None
            assert f1.completed_at <= f2.completed_at
            # A retry of a taken seq_id gets the original future; one too far ahead of the
            # model's next is refused.
            assert box.fwdbwd("alice", m, 2, [4]) is f2
            with pytest.raises(UserError, match="too far ahead"):
                box.fwdbwd("alice", m, 3 + 100_001, [4])

    run(go())


def test_a_cut_forward_backward_is_merged_in_datum_order(tiny_dir, tmp_path):
    async def go():
        async with service(tiny_dir, tmp_path, token_budget=24) as box:
            m = await box.create("alice")
            steps = box.svc.lanes.all[0].planner.steps
            lengths = [9, 3, 11, 5, 7]  # 35 tokens: more than one 24-token step
            f = box.fwdbwd("alice", m, 1, lengths, seed=4)
            await done(f)
            assert f.error is None
            assert box.svc.lanes.all[0].planner.steps >= steps + 2  # it ran in pieces
            cut = logprobs(result(f))
            assert [len(x) for x in cut] == lengths  # one result, datums in order
            whole = box.fwdbwd("alice", m, 2, lengths[:1], seed=4, forward_only=True)
            await done(whole)
            assert max(abs(p - q) for p, q in zip(cut[0], logprobs(result(whole))[0],
                                                  strict=True)) < 1e-4

    run(go())


def test_a_refused_request_takes_its_seq_id(tiny_dir, tmp_path):
    async def go():
        async with service(tiny_dir, tmp_path) as box:
            m = await box.create("alice")
            f2 = box.fwdbwd("alice", m, 2, [4])
            box.svc.refuse("alice", m, 1, "data[0]: bad")  # seq 1 was refused at the door
            await done(f2)  # seq 2 did not wait for seq 1 forever
            assert f2.error is None
            assert box.svc.lanes.all[0].planner.queues.next_seq(m) == 3
            # The refusal's future failed with its reason.
            assert refused(box.store) == ["error"]
            # A refused seq_id that already ran takes nothing.
            box.svc.refuse("alice", m, 2, "late")
            assert box.svc.lanes.all[0].planner.queues.next_seq(m) == 3
            assert refused(box.store) == ["error"]

    run(go())


def test_idle_unload_and_reload_through_residency(tiny_dir, tmp_path):
    async def go():
        async with service(tiny_dir, tmp_path) as box:
            svc = box.svc
            m = await box.create("alice")
            await done(box.fwdbwd("alice", m, 1, [6], seed=5), box.optim("alice", m, 2))
            before = box.fwdbwd("alice", m, 3, [6], seed=6, forward_only=True)
            await done(before)
            box.store.runs.touch(m)
            await asyncio.sleep(0.05)
            await svc.lanes.all[0].residency.unload_idle(0.01)
            assert not svc.lanes.all[0].residency.is_open(m) and svc.lanes.all[0].residency.count() == 0
            row = box.store.runs.get(m)
            assert not row["live"] and row["idle_unloaded"] and row["next_seq"] == 4
            with pytest.raises(UserError, match="not loaded"):
                box.fwdbwd("alice", m, 4, [6])
            await svc.ensure_loaded(box.store.runs.get(m))
            assert svc.lanes.all[0].residency.is_open(m) and svc.lanes.all[0].residency.count() == 1
            assert box.store.runs.get(m)["live"]
            after = box.fwdbwd("alice", m, 4, [6], seed=6, forward_only=True)
            await done(after)
            assert after.error is None
            x, y = logprobs(result(before))[0], logprobs(result(after))[0]
            assert max(abs(p - q) for p, q in zip(x, y, strict=True)) < 1e-5  # same weights

    run(go())


def test_futures_fail_cleanly_and_the_loop_goes_on(tiny_dir, tmp_path):
    async def go():
        async with service(tiny_dir, tmp_path) as box:
            svc = box.svc
            m = await box.create("alice")
            # An op that fails in the engine fails its own future, with its reason; its
            # `after` hears it; the model goes on.
            (tmp_path / "checkpoints").write_text("")  # no directory can be made under it
            run = box.store.runs.get(m)
            f = svc.save("alice", run, 1, "weights", "first", optimizer=True, user_metadata={},
                         ttl_s=None, overwrite=False, answer=lambda path: (b"{}", "text/plain"))
            await done(f)
            assert f.error is not None and f.error[1] == "server"
            # Its store row says why: behind the service, the save's callback ran.
            ckpt = box.store.checkpoints.get(f"tinker://{m}/weights/first")
            assert ckpt["status"] == "corrupt" and ckpt["error"] == f.error[0]
            # The executor itself failing (a bug): the step's futures fail as server errors.
            real = svc.lanes.all[0].executor.run_ops

            async def broken(kind, ops, micro_tokens=0):
                raise RuntimeError("boom")

            svc.lanes.all[0].executor.run_ops = broken
            g = box.fwdbwd("alice", m, 2, [4])
            await done(g)
            assert g.error == ("server error: RuntimeError: boom", "server")
            svc.lanes.all[0].executor.run_ops = real
            h = box.fwdbwd("alice", m, 3, [4])
            await done(h)
            assert h.error is None
            # Shutdown fails what is still waiting (seq 5 waits for seq 4, never sent).
            stuck = box.optim("alice", m, 5)
            await svc.life.shutdown()
            assert stuck.done.is_set() and stuck.error[1] == "server"
            assert "stopped" in stuck.error[0]

    run(go())


def test_sampler_weights_are_sampled_from_a_device_copy(tiny_dir, tmp_path):
    # An RL loop saves sampler weights, then samples at once: the workers keep a device
    # copy at the save, so the first sample reads no files. Proven by removing them: the
    # sample still runs, and gives what an engine loading those files gives.
    import shutil

    from twinkled.engine import Engine
    from twinkled.protocol.frames import SampleF, SamplingF
    from twinkled.protocol.types import SampleRequest, SamplingParams

    async def go():
        async with service(tiny_dir, tmp_path) as box:
            m = await box.create("ann")
            await done(box.fwdbwd("ann", m, 1, [6, 5]), box.optim("ann", m, 2, lr=0.2))
            saved = box.svc.save_for_sampler("ann", box.store.runs.get(m), 3, None,
                                             user_metadata={}, ttl_s=None,
                                             answer=lambda s: (str(s).encode(), "text/plain"))
            await done(saved)
            assert saved.error is None, saved.error
            sampler = box.store.samplers.get(saved.payload.decode())
            ckpt = box.store.checkpoints.get(sampler["model_path"])
            # The model trains on: the sampler must keep the weights of its save.
            await done(box.fwdbwd("ann", m, 4, [7]), box.optim("ann", m, 5, lr=0.2))
            kept = tmp_path / "kept"
            shutil.copytree(ckpt["dir"], kept)
            shutil.rmtree(ckpt["dir"])
            prompt = [3, 1, 4, 1, 5]
            frame = SampleF(f"sampler:{sampler['model_path']}@{ckpt['sha256'][:16]}",
                            buf(prompt, "int64"), SamplingF(6, 0.0, -1, 1.0, None, []), 1,
                            False, ckpt["dir"])
            f = box.svc.sample("ann", sampler, frame, box.keep)
            await done(f)
            assert f.error is None, f.error
            return result(f).sequences[0].tokens, kept

    tokens, kept = run(go())
    eng = Engine(tiny_dir, dtype="float32", device="cpu")
    eng.load("s", kept, optimizer=False)
    want = eng.sample([SampleRequest("s", prompt_tensor([3, 1, 4, 1, 5]),
                                     SamplingParams(max_tokens=6, temperature=0.0, stop=[]))])
    assert list(tokens) == list(want[0].sequences[0].tokens)


def prompt_tensor(ids):
    import torch

    return torch.tensor(ids, dtype=torch.long)


def test_gather_waits_for_the_optim_step_behind_a_forward_backward(tiny_dir, tmp_path):
    """A client that sends optim_step right behind each forward_backward gets both run in
    one step, even when the optim_step comes some milliseconds later; a client that
    accumulates gradients (no optim_step behind) is not waited for again."""
    async def go():
        async with service(tiny_dir, tmp_path, gather_ms=2000) as box:
            a = await box.create("alice")
            await done(box.fwdbwd("alice", a, 1, [5]), box.optim("alice", a, 2))
            steps = box.svc.lanes.all[0].planner.steps
            f = box.fwdbwd("alice", a, 3, [5])
            await asyncio.sleep(0.2)  # the optim_step arrives well after the fwdbwd
            o = box.optim("alice", a, 4)
            await done(f, o)
            assert box.svc.lanes.all[0].planner.steps == steps + 1  # one step: fwdbwd then optim
            assert o.error is None and result(o).applied
            gather = box.svc.lanes.all[0].core.gather
            assert gather.is_paired(a)  # so the gather after its rows waits for its optim
            # Accumulation: two fwdbwd without an optim_step; the gather gives up once
            # (at most gather_ms) and then stops waiting for this model's optim_steps.
            await done(box.fwdbwd("alice", a, 5, [5]))
            await done(box.fwdbwd("alice", a, 6, [5]))
            assert not gather.is_paired(a)  # no more waits for an optim_step behind
            await done(box.fwdbwd("alice", a, 7, [5]))
            assert not gather.is_paired(a)

    run(go())


def test_an_optim_step_sent_before_its_forward_backward_finished_pairs_them(tiny_dir,
                                                                           tmp_path):
    """tinker's client sends optim_step right behind forward_backward, before its result.
    Seen once (the optim_step arrives while the forward_backward runs, too late for its
    step), the gather waits for the optim_step from then on and each later pair runs as
    one step. Only a pair that happened to arrive within the gather's last 2 ms used to be
    seen together, which through HTTP on a GPU was almost never: every round paid a
    barrier step of its own."""
    async def go():
        async with service(tiny_dir, tmp_path, gather_ms=2000) as box:
            a = await box.create("alice")
            planned = box.svc.lanes.all[0].planner.steps
            f = box.fwdbwd("alice", a, 1, [48] * 4)
            while box.svc.lanes.all[0].planner.steps == planned:  # its step has begun, without the optim
                await asyncio.sleep(0.001)
            o = box.optim("alice", a, 2)
            await done(f, o)
            assert box.svc.lanes.all[0].planner.steps == planned + 2  # the first pair: two steps
            f = box.fwdbwd("alice", a, 3, [48] * 4)
            await asyncio.sleep(0.2)  # the optim_step arrives well after the fwdbwd
            o = box.optim("alice", a, 4)
            await done(f, o)
            assert box.svc.lanes.all[0].planner.steps == planned + 3  # one step: fwdbwd then optim
            assert o.error is None and result(o).applied

    run(go())


def test_a_late_optim_step_rides_another_tenants_training_step(tiny_dir, tmp_path):
    """An optim_step that missed its rows' step runs at the end of the next training step
    (another tenant's rows), not in a step of its own, and takes the same step it would
    have taken alone: the adapter then scores as a control that stepped in a barrier step."""
    async def go():
        async with service(tiny_dir, tmp_path) as box:
            a = await box.create("alice", seed=7)
            b = await box.create("bob")
            c = await box.create("carol", seed=7)  # the control: alice's twin
            await done(box.fwdbwd("alice", a, 1, [5, 7], seed=1))
            steps = box.svc.lanes.all[0].planner.steps
            o = box.optim("alice", a, 2)  # late, beside bob's rows
            fb = box.fwdbwd("bob", b, 1, [6], seed=2)
            await done(o, fb)
            assert box.svc.lanes.all[0].planner.steps == steps + 1  # bob's rows, then alice's optim_step
            assert o.error is None and result(o).applied and fb.error is None
            await done(box.fwdbwd("carol", c, 1, [5, 7], seed=1))
            steps = box.svc.lanes.all[0].planner.steps
            await done(box.optim("carol", c, 2))
            assert box.svc.lanes.all[0].planner.steps == steps + 1  # a barrier step of its own
            fa = box.fwdbwd("alice", a, 3, [5, 7], seed=1, forward_only=True)
            fc = box.fwdbwd("carol", c, 3, [5, 7], seed=1, forward_only=True)
            await done(fa, fc)
            d = await box.create("dave", seed=7)  # alice's twin, untrained
            before = box.fwdbwd("dave", d, 1, [5, 7], seed=1, forward_only=True)
            await done(before)
            for x, y in zip(logprobs(result(fa)), logprobs(result(fc)), strict=True):
                assert x == pytest.approx(y, abs=1e-5)
            # ... and the step did something: alice no longer scores as an untrained twin
            assert logprobs(result(fa)) != logprobs(result(before))

    run(go())


def test_a_client_late_once_is_still_waited_for(tiny_dir, tmp_path):
    """A pipelining client whose optim_step once came too late for its forward_backward's
    step (it ran in a step of its own) is still waited for next time: the pair rides one
    step again. It used to be dropped, and every later pair paid a barrier step."""
    async def go():
        async with service(tiny_dir, tmp_path, gather_ms=300) as box:
            a = await box.create("alice")
            planned = box.svc.lanes.all[0].planner.steps
            f = box.fwdbwd("alice", a, 1, [48] * 4)
            while box.svc.lanes.all[0].planner.steps == planned:
                await asyncio.sleep(0.001)
            await done(f, box.optim("alice", a, 2))  # seen: alice pipelines
            before = box.svc.lanes.all[0].planner.steps
            f = box.fwdbwd("alice", a, 3, [48] * 4)
            await asyncio.sleep(1.5)  # far too late: past every window
            await done(f, box.optim("alice", a, 4))
            assert box.svc.lanes.all[0].planner.steps == before + 2  # the rows, then the optim_step
            before = box.svc.lanes.all[0].planner.steps
            f = box.fwdbwd("alice", a, 5, [48] * 4)
            await asyncio.sleep(0.1)  # within the window
            o = box.optim("alice", a, 6)
            await done(f, o)
            assert box.svc.lanes.all[0].planner.steps == before + 1  # one step: still paired
            assert o.error is None and result(o).applied

    run(go())


def test_an_adapter_that_does_not_fit_parks_the_least_recently_used_one(tiny_dir,
                                                                          tmp_path):
    """With room for two rank-4 adapters, a third create_model is not refused: the least
    recently used idle adapter is parked (host memory off here: to disk) and comes back on
    its next request, parking another; all three train (core/tiers.py)."""
    from twinkled.protocol.config import Config as C
    from twinkled.protocol.sizing import adapter_bytes

    model_cfg = C(model=tiny_dir).model_config
    gb = 2.5 * adapter_bytes(model_cfg, 4) / 2**30

    async def go():
        async with service(tiny_dir, tmp_path, adapter_memory_gb=gb,
                           host_adapter_memory_gb=0) as box:
            residency = box.svc.lanes.all[0].residency
            a, b = await box.create("alice"), await box.create("bob")
            c = await box.create("carol")
            await done(box.fwdbwd("carol", c, 1, [4]))
            assert residency.count() == 2 and not residency.is_open(a)  # alice, the coldest
            assert box.store.runs.get(a)["idle_unloaded"]
            await box.svc.ensure_loaded(box.store.runs.get(a))
            assert residency.count() == 2 and not residency.is_open(b)
            fa = box.fwdbwd("alice", a, 1, [5])
            await done(fa)
            assert fa.error is None
            assert residency.tiers.status()["moves"] == {"to_disk": 2, "from_disk": 1}

    run(go())
