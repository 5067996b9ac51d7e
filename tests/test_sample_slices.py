"""Sliced sampling (twinkled/core/pending_samples.py): a long generation decodes in slices
between other steps, so it never holds back another tenant's short sample or training
step; streams get tokens per slice; a stream whose reader goes away leaves the running
batch; a worker that dies fails the samples it was decoding instead of hanging them."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sqlite3
import time
import urllib.request

import pytest
from daemon import Daemon, ctl_status, make_key
from helpers import make_engine
from test_service import done, run, service

from twinkled.protocol.errors import UserError
from twinkled.protocol.frames import SampleF, SamplingF, buf
from twinkled.protocol.types import SampleRequest, SamplingParams

tinker = pytest.importorskip("tinker")
T = 120
LONG = 1500  # tokens of the long sample: many slices of 20 ms on a CPU


@pytest.fixture(scope="module")
def sliced(tiny_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("sliced")
    cfg = data / "twinkled.toml"
    # (Slices while nothing else waits: long enough that only a nudge from arriving work
    # ends one before its samples finish.)
    cfg.write_text("sample_slice_ms = 20\nsample_long_slice_ms = 600000\n")
    keys = {t: make_key(data, t) for t in ("alice", "bob", "carol")}
    d = Daemon(tiny_dir, data, data / "twinkled.log", "--config", str(cfg))
    d.keys = keys
    yield d
    d.stop()


def _sampler(d, tenant, tiny_dir):
    sc = tinker.ServiceClient(base_url=d.url, api_key=d.keys[tenant])
    return sc.create_sampling_client(base_model=tiny_dir.name).result(timeout=T)


def _greedy(n: int):
    return tinker.types.SamplingParams(max_tokens=n, temperature=0.0)


def _completed(d, tenant: str, kind: str) -> float:
    """When the tenant's (last) request of `kind` completed, by the daemon's store."""
    with sqlite3.connect(d.data_dir / "twinkle.db") as db:
        (at,) = db.execute("SELECT max(completed_at) FROM futures WHERE tenant = ? AND kind = ?",
                           (tenant, kind)).fetchone()
    assert at is not None, (tenant, kind)
    return at


def _slices(d) -> float:
    """How many "slice" steps the daemon has run (its /metrics)."""
    with urllib.request.urlopen(f"{d.url}/metrics", timeout=5) as r:
        text = r.read().decode()
    m = re.search(r'twinkle_step_seconds_count\{kind="slice"\} (\S+)', text)
    return float(m.group(1)) if m else 0.0


def _wait_sent(d) -> None:
    """Until a sample is in the worker's hands (the daemon's `samples_running`)."""
    deadline = time.time() + T
    while not ctl_status(d.data_dir)["samples_running"]:
        assert time.time() < deadline
        time.sleep(0.01)


def test_a_long_sample_holds_back_neither_a_short_one_nor_training(sliced, tiny_dir):
    long_sampler = _sampler(sliced, "alice", tiny_dir)
    short_sampler = _sampler(sliced, "bob", tiny_dir)
    tc = tinker.ServiceClient(base_url=sliced.url, api_key=sliced.keys["carol"]) \
        .create_lora_training_client(base_model=tiny_dir.name, rank=4, seed=1).result(timeout=T)
    tok = tc.get_tokenizer()
    ids = tok("the sun and the sea are big.").input_ids
    datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": ids[1:]})
    long_prompt, short_prompt = tok("the sun and").input_ids, tok("a cat").input_ids

    fa = long_sampler.sample(tinker.types.ModelInput.from_ints(long_prompt), 1, _greedy(LONG))
    _wait_sent(sliced)  # alone: in a slice that only a nudge from what comes next cuts short
    fb = short_sampler.sample(tinker.types.ModelInput.from_ints(short_prompt), 1, _greedy(4))
    fc = tc.forward_backward([datum], "cross_entropy")
    fo = tc.optim_step(tinker.types.AdamParams(learning_rate=1e-2))
    b = fb.result(timeout=T).sequences[0]
    assert fc.result(timeout=T).metrics["loss:sum"] > 0
    fo.result(timeout=T)
    a = fa.result(timeout=T).sequences[0]

    # The short sample and the training round finished while the long one still ran.
    finished = _completed(sliced, "alice", "sample")
    assert _completed(sliced, "bob", "sample") < finished
    assert _completed(sliced, "carol", "optim_step") < finished
    # Once nothing else waited, the long sample decoded on in slices of up to
    # sample_long_slice_ms (far longer than it takes), not in slices of 20 ms; what
    # arrived meanwhile cut its slice short at 20 ms (the order above).
    assert 1 <= _slices(sliced) <= 3
    # Each is what the engine samples running it to completion, alone.
    engine = make_engine(tiny_dir)
    for got, prompt, n in ((a, long_prompt, LONG), (b, short_prompt, 4)):
        (want,) = engine.sample([SampleRequest(None, prompt, SamplingParams(n, temperature=0))])
        assert list(got.tokens) == want.sequences[0].tokens
        assert list(got.logprobs) == pytest.approx(want.sequences[0].logprobs, abs=1e-3)
    assert len(a.tokens) == LONG


def test_a_killed_worker_fails_the_sample_it_was_decoding(sliced, tiny_dir):
    sampler = _sampler(sliced, "alice", tiny_dir)
    prompt = tinker.types.ModelInput.from_ints([5, 6, 7])
    fut = sampler.sample(prompt, 1, _greedy(LONG))
    _wait_sent(sliced)
    old = sliced.workers()
    os.kill(old[0], signal.SIGKILL)
    with pytest.raises(tinker.RequestFailedError, match="restarted"):
        fut.result(timeout=T)
    sliced.wait_workers(1, old=set(old))
    assert len(sampler.sample(prompt, 1, _greedy(3)).result(timeout=T).sequences[0].tokens) == 3


def _frame(prompt: list[int], max_tokens: int) -> SampleF:
    return SampleF(None, buf(prompt, "int64"), SamplingF(max_tokens, 0.0, -1, 1.0, None, None))


def test_streams_come_per_slice_and_a_gone_reader_leaves_the_running_batch(tiny_dir, tmp_path):
    async def go():
        async with service(tiny_dir, tmp_path, sample_slice_ms=5) as box:
            box.store.tenants.ensure("ann")
            svc = box.svc
            kept = svc.sample_stream("ann", "base", _frame([3, 1, 4], 300))
            gone = svc.sample_stream("ann", "base", _frame([2, 7], 1000))
            it = gone.__aiter__()
            first = await it.__anext__()  # it runs: its first slice's tokens came
            assert first.tokens and len(svc.lanes.all[0].core.samples) == 2
            assert gone.cancel()
            with pytest.raises(UserError, match="client went away"):
                await it.__anext__()
            pieces = [p async for p in kept]
            same = svc.sample("ann", {"id": "base"}, _frame([3, 1, 4], 300), box.keep)
            await done(same)
            return pieces, same, len(svc.lanes.all[0].core.samples), svc.lanes.all[0].core.idle()

    pieces, same, pending, idle = run(go())
    import pickle

    want = pickle.loads(same.payload).sequences[0]
    assert len(pieces) > 1 and {p.choice for p in pieces} == {0}
    assert [t for p in pieces for t in p.tokens] == want.tokens
    assert [x for p in pieces for x in p.logprobs] == pytest.approx(want.logprobs, abs=1e-5)
    assert [p.finish for p in pieces] == [None] * (len(pieces) - 1) + [want.stop_reason]
    assert pending == 0 and idle


def test_in_process_a_nudge_ends_a_long_slice_for_a_sample_that_arrives(tiny_dir, tmp_path):
    """The in-process group (InProcessGroup.nudge): a long sample alone decodes in a slice
    of up to sample_long_slice_ms; a short one that arrives ends it at sample_slice_ms,
    joins, and is answered first; the long one then goes on to its end in one more."""
    async def go():
        async with service(tiny_dir, tmp_path, sample_slice_ms=20,
                           sample_long_slice_ms=600_000) as box:
            box.store.tenants.ensure("ann")
            svc, core = box.svc, box.svc.lanes.all[0].core
            long = svc.sample("ann", {"id": "base"}, _frame([3, 1, 4], 400), box.keep)
            while not len(core.samples):  # in the running batch's hands
                await asyncio.sleep(0.005)
            short = svc.sample("ann", {"id": "base"}, _frame([2, 7], 4), box.keep)
            await done(short)
            running = not long.done.is_set()
            await done(long)
            return long, short, running

    long, short, running = run(go())
    import pickle

    assert long.error is None and short.error is None and running
    assert len(pickle.loads(long.payload).sequences[0].tokens) == 400


def test_a_step_that_fails_to_plan_or_build_loses_only_its_own_samples(tiny_dir, tmp_path):
    """A bug where a step is planned or built (injected once each): a sample whose step
    could not be built fails with a server error, the planning failure costs nothing, and
    the engine loop goes on serving (it used to die, and the daemon hung)."""
    async def go():
        async with service(tiny_dir, tmp_path) as box:
            box.store.tenants.ensure("ann")
            svc, lane = box.svc, box.svc.lanes.all[0]
            real_step, real_next = lane.core.samples.step, lane.planner.next_step
            left = {"build": 1, "plan": 1}

            def once(what, real):
                def call(*args, **kwargs):
                    if left[what]:
                        left[what] -= 1
                        raise RuntimeError(f"injected {what}")
                    return real(*args, **kwargs)
                return call

            lane.core.samples.step = once("build", real_step)
            first = svc.sample("ann", {"id": "base"}, _frame([3, 1, 4], 5), box.keep)
            await done(first)
            lane.planner.next_step = once("plan", real_next)
            second = svc.sample("ann", {"id": "base"}, _frame([3, 1, 4], 5), box.keep)
            await asyncio.wait_for(done(second), 60)  # (a dead loop would never answer)
            return first, second, left

    first, second, left = run(go())
    assert "server error: RuntimeError: injected build" in first.error
    assert second.error is None and left == {"build": 0, "plan": 0}


def test_a_sample_too_large_for_the_busy_batch_waits_for_it_to_drain(tiny_dir, tmp_path):
    """A 1 MiB KV pool holds ~1024 tokens of the tiny model: 4 samples of 400 tokens fit only
    a pool made for them, which the running batch can become only once it is idle. Sent
    while a long sample runs, the large one waits for it (no "does not fit" error)."""
    async def go():
        async with service(tiny_dir, tmp_path, sample_kv_mb=1, sample_slice_ms=5) as box:
            box.store.tenants.ensure("ann")
            svc = box.svc
            running = svc.sample_stream("ann", "base", _frame([3, 1, 4], 300))
            it = running.__aiter__()
            await it.__anext__()  # it runs
            big = _frame([2, 7, 1], 400)
            big.params.stop, big.num_samples = [], 4
            f = svc.sample("ann", {"id": "base"}, big, box.keep)
            rest = [p async for p in running]
            await done(f)
            return f, rest

    f, rest = run(go())
    import pickle

    assert f.error is None, f.error
    assert [len(s.tokens) for s in pickle.loads(f.payload).sequences] == [400] * 4
    assert rest and rest[-1].finish is not None


def test_a_sampler_with_running_samples_is_not_evicted(tiny_dir, tmp_path, monkeypatch):
    """A rank's SampleRunner: samplers kept loaded are bounded (SAMPLER_ADAPTERS, least
    recently used first), but one whose sample still decodes stays until it finishes; a
    cancelled sample leaves the running batch."""
    from twinkled.protocol.frames import StepF
    from twinkled.protocol.types import LoraConfig
    from twinkled.workers import sampling

    monkeypatch.setattr(sampling, "SAMPLER_ADAPTERS", 1)
    engine = make_engine(tiny_dir)
    dirs = []
    for name in ("one", "two"):
        engine.add_adapter(name, LoraConfig(rank=4, seed=len(dirs)))
        engine.save(name, tmp_path / name)
        dirs.append(str(tmp_path / name))
    runner = sampling.SampleRunner(engine, 0, 0, 1, True, False, None)

    def op(adapter: str, path: str, max_tokens: int, key: str) -> SampleF:
        f = SampleF(adapter, buf([3, 1, 4], "int64"),
                    SamplingF(max_tokens, 0.0, -1, 1.0, None, []), load_from=path)
        f.key = key
        return f

    assert runner.run(StepF(0, "sample", [op("s1", dirs[0], 200, "long")], 0.001)) == []
    assert runner.news().running == ["long"]
    got = runner.run(StepF(0, "sample", [op("s2", dirs[1], 2, "short")], 5.0))
    assert [o.key for o in got] == ["short"]
    assert engine.has_adapter("s1")  # over the bound, but "long" still runs on it
    while "long" in runner.news().running:
        got = runner.run(StepF(0, "slice", [], 5.0))
    assert [o.key for o in got] == ["long"] and len(got[0].sample.sequences[0].tokens) == 200
    runner.run(StepF(0, "slice", [], 5.0))
    assert not engine.has_adapter("s1") and engine.has_adapter("s2")  # then it goes

    assert runner.run(StepF(0, "sample", [op("s2", dirs[1], 200, "gone")], 0.001)) == []
    assert runner.run(StepF(0, "slice", [], 5.0, cancel=["gone"])) == []
    assert runner.news().running == [] and engine.sample_idle


def test_a_rank_is_stocked_once_a_batchs_worth_of_rows_waits(tiny_dir):
    """A rank reports `stocked` (the daemon then holds new samples back) only once as many
    rows wait for room as its running batch decodes at once, so a row that finishes is
    replaced without a round trip to the daemon; a few waiting rows are not enough."""
    from twinkled.core.pending_samples import PendingSamples, Sliced
    from twinkled.protocol.frames import ReplyF, SlicedF, StepF
    from twinkled.workers import sampling

    engine = make_engine(tiny_dir, sample_rows=4)
    runner = sampling.SampleRunner(engine, 0, 0, 1, True, False, None)
    keys = iter(range(100))

    def op(n: int) -> SampleF:
        f = SampleF(None, buf([3, 1, 4], "int64"), SamplingF(300, 1.0, -1, 1.0, None, []),
                    num_samples=n)
        f.key = f"k{next(keys)}"
        return f

    runner.run(StepF(0, "sample", [op(2), op(2)], 0.001))  # 4 rows: the batch is full
    news = runner.news()
    assert news.waiting == 0 and not news.stocked
    runner.run(StepF(0, "sample", [op(2)], 0.001))  # 2 rows wait: room for more
    news = runner.news()
    assert news.waiting == 1 and not news.stocked
    runner.run(StepF(0, "sample", [op(1), op(1)], 0.001))  # 4 rows wait: a batch's worth
    news = runner.news()
    assert news.waiting == 3 and news.stocked

    # The daemon's side: any rank stocked holds new samples back; waiting alone does not.
    pending = PendingSamples(0.25)
    pending.step([type("Op", (), {"frame": op(1), "future": type("F", (), {"id": "x"}),
                                  "stream": None})()])

    def settle(*ranks: SlicedF) -> bool:
        pending.settle(Sliced.of([ReplyF(0, 0, [], sampling=s) for s in ranks]))
        return pending.backlog

    assert not settle(SlicedF(["x"], waiting=3))
    assert settle(SlicedF(["x"], waiting=3, stocked=True), SlicedF([]))
    assert not settle(SlicedF(["x"]))
    while runner.news().running:  # the rest decode to the end
        runner.run(StepF(0, "slice", [], 5.0))
