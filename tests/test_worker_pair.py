"""Two worker ranks of one group (`slow_pair`, one daemon for the module): they compute what
one worker does, stay answerable while a step is held, trace each rank's share of a step,
come back from kills with every adapter, ignore frames from outside the group, and a pass
that fails on one rank fails alone. (Moved here from tests/test_workers.py and
tests/test_durability.py, whose own daemons they shared no more than this one.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemon import Daemon, ctl_status, make_key
from helpers import (
    checkpoint_tensors,
    hold_workers,
    lora_client,
    tinker_datums,
    tinker_logprobs,
    tinker_step,
)

tinker = pytest.importorskip("tinker")
T = 120
TEXTS = ["the sun and the sea are big.", "a cat.", "one two three four five six seven",
         "blue green"]
# Rollouts of one long prompt (over shared_prefix's 32 tokens): one replica takes them all.
PROMPT = "the quick brown fox jumps over the lazy dog near the river bank at dawn, " * 3
ROLLOUTS = [PROMPT + end for end in ("and sleeps.", "then runs far away.", "and eats.")]
LONG = PROMPT * 2 + "the end."  # ~230 tokens: split over the ranks at --cp 2
CP_MIN = 200
# A datum of 13 tokens makes a pass fail after its backward (TWINKLED_TEST_FAIL_TOKENS).
POISON = [tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([5] * 13),
                             loss_fn_inputs={"target_tokens": [6] * 13})]


def _data(tok, texts=TEXTS):
    return tinker_datums(tok, texts)


_step, _logprobs, _client = tinker_step, tinker_logprobs, lora_client


def _fb(tc, data):
    return tc.forward_backward(data, "cross_entropy").result(timeout=T)


def _flat(rows: list[list[float]]) -> list[float]:
    return [x for row in rows for x in row]


@pytest.fixture(scope="module")
def slow_pair(tiny_dir, tmp_path_factory):
    """Two CPU workers (at --cp 2: rows shorter than CP_MIN tokens, all but one test's,
    run data-parallel) whose steps take 1 s: time to act in the middle of one. Traced
    (TWINKLED_TRACE), for test_a_traced_pair_records_each_ranks_share_of_a_step."""
    data_dir = tmp_path_factory.mktemp("slow")
    keys = {t: make_key(data_dir, t) for t in ("alice", "bob")}
    # At --cp 2 (test_two_workers_compute_what_one_does), and a row limit below the model's
    # 2048 positions: the workers' word reaches the door and get_server_capabilities.
    (data_dir / "cp.toml").write_text(f"cp_min_tokens = {CP_MIN}\nmax_seq_len = 1024\n")
    # A pass over a datum of 13 tokens fails, and rank 1 dies after an optim_step once
    # data_dir/die-after-optim exists (injected: test_a_pass_that_fails_on_one_data_...).
    d = Daemon(tiny_dir, data_dir, data_dir / "log", "--workers", "2", "--cp", "2",
               "--config", str(data_dir / "cp.toml"),
               env={"TWINKLED_TEST_STEP_DELAY": "1.0",
                    "TWINKLED_TRACE": str(data_dir / "trace.jsonl"),
                    "TWINKLED_TEST_FAIL_TOKENS": "13",
                    "TWINKLED_TEST_DIE_AFTER_OPTIM": str(data_dir / "die-after-optim")})
    d.keys, d.trace = keys, data_dir / "trace.jsonl"
    yield d
    d.stop()


def test_two_workers_compute_what_one_does(daemon, slow_pair, tiny_dir):
    """Rows split over 2 gloo ranks and summed gradients give the 1-worker adapter. The pair
    (slow_pair) runs at --cp 2 (context parallelism, engine/context_parallel.py): a row
    longer than cp_min_tokens runs over both ranks, the others data-parallel as before. The
    one worker is the session's daemon (a daemon start less; its small token budget cuts
    the batch into several passes, which sum to the same gradients)."""
    results = {}
    for n, d in ((1, daemon), (2, slow_pair)):
        key = d.keys["alice"]
        assert len(d.workers()) == n
        sc = tinker.ServiceClient(base_url=d.url, api_key=key)
        caps = tinker.RestClient(base_url=d.url, api_key=key).get_server_capabilities(
        ).result(timeout=T).supported_models[0]
        assert caps.max_context_length == (1024 if n == 2 else 2048)
        tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=4,
                                            seed=7).result(timeout=T)
        tok = tc.get_tokenizer()
        data = _data(tok) + _data(tok, ROLLOUTS) + _data(tok, [LONG])
        assert len(data[-1].model_input.to_ints()) > CP_MIN > max(
            len(d.model_input.to_ints()) for d in data[:-1])
        losses = [_step(tc, data).metrics["loss:sum"] for _ in range(3)]
        path = tc.save_state("after3").result(timeout=T).path
        results[n] = (losses, _logprobs(tc, data), checkpoint_tensors(d.data_dir, path))
    (l1, lp1, ck1), (l2, lp2, ck2) = results[1], results[2]
    assert l1 == pytest.approx(l2, rel=1e-4)
    assert l1[-1] < l1[0]  # it trained
    for a, b in zip(lp1, lp2, strict=True):  # every datum's outputs, in the request's order
        assert a == pytest.approx(b, abs=1e-4)
    assert ck1.keys() == ck2.keys()
    for k in ck1:
        assert ck1[k].float().sub(ck2[k].float()).abs().max() <= 1e-5 + 1e-4 * ck1[k].abs().max(), k


def test_healthz_answers_fast_during_a_long_step(slow_pair, tiny_dir):
    """healthz is answered while a step is held in the workers: one worker is stopped
    (SIGSTOP), so the step cannot end before it is let go, whatever the box's speed."""
    tc = _client(slow_pair, "alice", tiny_dir, 1)
    data = _data(tc.get_tokenizer())
    held = slow_pair.workers()[1]
    os.kill(held, signal.SIGSTOP)
    try:
        fut = tc.forward_backward(data, "cross_entropy")
        for _ in range(10):
            assert slow_pair.health()["status"] == "ok"
        assert not fut.future().done()  # the step was still held through all of them
    finally:
        os.kill(held, signal.SIGCONT)
    assert fut.result(timeout=T).metrics["loss:sum"] > 0


def test_a_traced_pair_records_each_ranks_share_of_a_step(slow_pair, tiny_dir):
    """The step trace (TWINKLED_TRACE, twinkled/protocol/trace.py) that the host-path
    profile is read from: per step the loop's phases and each rank's timings, which
    bench/trace_report.py tabulates. Only this test's steps are read (the pair's other
    tests kill workers)."""
    begin = slow_pair.trace.stat().st_size if slow_pair.trace.exists() else 0
    tc = _client(slow_pair, "bob", tiny_dir, 9)
    ids = list(range(5, 37))
    datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": ids[1:]})
    for _ in range(2):
        _step(tc, [datum, datum], lr=1e-3)
    with open(slow_pair.trace, "rb") as f:
        f.seek(begin)
        mine = f.read()
    mine = mine[:mine.rfind(b"\n") + 1]  # whole lines: the daemon may be writing one now
    events = [json.loads(line) for line in mine.decode().splitlines()]
    loops = [e for e in events if e["event"] == "loop"]
    groups = [e for e in events if e["event"] == "group"]
    assert {"train", "barrier"} <= {e["kind"] for e in loops}
    for e in loops:  # the loop's phases, in order
        assert e["planned"] <= e["executing"] <= e["completing"] <= e["done"]
    # what the planner expected of a training step: its time, its tokens, its micro-batches
    assert all(e["predicted"] > 0 and e["tokens"] > 0 and e["micro_tokens"] >= 0
               for e in loops if e["kind"] == "train")
    train = [g for g in groups if g["kind"] == "train"]
    assert train and all(len(g["ranks"]) == 2 for g in groups)
    for g in train:
        for r in g["ranks"]:  # each rank's stamps line up with the daemon's clock
            assert g["sent"] <= r["began"] <= r["began"] + r["busy"] <= r["arrived"]
    # Each of the two rows ran on its own rank: both issued a forward and a backward.
    assert any(all(r["phases"]["forward"] > 0 and r["phases"]["backward"] > 0
                   for r in g["ranks"]) for g in train)
    report = Path(__file__).resolve().parents[1] / "bench" / "trace_report.py"
    trace = slow_pair.data_dir / "mine.jsonl"
    trace.write_bytes(mine)
    out = subprocess.run([sys.executable, str(report), str(trace)], capture_output=True,
                         text=True, check=True).stdout
    assert "rank 1 busy" in out and "step (train: fwdbwd" in out


def test_killed_worker_fails_one_step_and_restores_every_adapter(slow_pair, tiny_dir):
    """Then a second kill in a row, of the other worker (the chaos test, test_chaos.py,
    kills at random while tenants train): each kill one restart, and it still serves."""
    counted = slow_pair.metric("twinkle_worker_restarts_total")
    alice = _client(slow_pair, "alice", tiny_dir, 2)
    bob = _client(slow_pair, "bob", tiny_dir, 3)
    data = _data(alice.get_tokenizer())
    _step(alice, data)
    _step(bob, data[:2])
    time.sleep(0.5)  # the write-behind persistence of those steps
    before_path = alice.save_state("before").result(timeout=T).path
    want_a, want_b = _logprobs(alice, data), _logprobs(bob, data)

    old = slow_pair.workers()
    fut = alice.forward_backward(data, "cross_entropy")
    time.sleep(0.5)  # mid-step
    os.kill(old[1], signal.SIGKILL)
    with pytest.raises(tinker.RequestFailedError, match="restarted"):
        fut.result(timeout=T)
    # Answered at once: the group (a model load, seconds here, a minute on a big model)
    # is still coming back when the client hears its step failed.
    assert slow_pair.health()["status"] == "restarting"
    slow_pair.wait_workers(2, old=set(old))

    # Both tenants' adapters are back exactly, optimizer state included (the checkpoints
    # below are equal bit for bit); training goes on. Logprobs are compared to float
    # tolerance: a fresh worker's CPU kernels may sum in another order.
    for tc, want in ((alice, want_a), (bob, want_b)):
        got = _logprobs(tc, data)
        assert [x for row in got for x in row] == pytest.approx(
            [x for row in want for x in row], rel=1e-5, abs=1e-6)
    after_path = alice.save_state("after").result(timeout=T).path
    before = checkpoint_tensors(slow_pair.data_dir, before_path)
    after = checkpoint_tensors(slow_pair.data_dir, after_path)
    assert all(before[k].equal(after[k]) for k in before)
    assert _step(alice, data).metrics["loss:sum"] > 0
    assert _logprobs(alice, data) != want_a

    old = slow_pair.workers()
    os.kill(old[0], signal.SIGKILL)  # the other rank this time
    slow_pair.wait_workers(2, old=set(old))
    assert _step(bob, data[:1]).metrics["loss:sum"] > 0
    # Each kill was one restart, counted in /metrics and in the status.
    assert slow_pair.metric("twinkle_worker_restarts_total") == counted + 2
    assert ctl_status(slow_pair.data_dir)["restarts"] == counted + 2


def test_frames_from_outside_the_worker_group_are_ignored(slow_pair, tiny_dir):
    """A process that is not a rank of this group (an orphaned worker of a daemon that died,
    reconnecting to a port this daemon reuses) is ignored: its frames, readable or not,
    neither fail a step nor pass for a rank's answer."""
    import msgspec
    import zmq

    from twinkled.protocol.frames import OutcomeF, ReplyF

    args = ctl_status(slow_pair.data_dir)["workers"][0]  # its group and step socket
    tc = _client(slow_pair, "alice", tiny_dir, 4)
    data = _data(tc.get_tokenizer())
    pids = slow_pair.workers()
    socks = []
    for ident in (b"0123456789abcdef:0", b"rank-0", f"{args['group']}:9".encode()):
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, ident)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(args["endpoint"])
        socks.append(s)
    fut = tc.forward_backward(data, "cross_entropy")
    time.sleep(0.3)  # mid-step: the daemon is gathering its ranks' replies
    for s in socks:  # unreadable, and forged answers for every step id a rank could await
        s.send(b"\x01not msgpack")
        for step in range(1, 400):
            s.send(msgspec.msgpack.encode(ReplyF(step=step, rank=0, outcomes=[
                OutcomeF(0, error="forged", category="user")])))
    assert fut.result(timeout=T).metrics["loss:sum"] > 0
    tc.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result(timeout=T)
    assert len(_logprobs(tc, data)) == len(data)
    assert slow_pair.workers() == pids and slow_pair.health()["status"] == "ok"
    for s in socks:
        s.close()


def test_a_pass_that_fails_on_one_data_parallel_rank_fails_alone(slow_pair, tiny_dir):
    """Two data-parallel ranks (from tests/test_durability.py); a step holds a good tenant's forward_backward and the
    optim_step right behind it, and a bad tenant's datum that makes the pass fail (injected)
    on the one rank that gets it. The ranks agree that the pass failed before any of them
    enters the optim_step's gradient all-reduce, which the failed rank would never join:
    the bad request fails alone, the good tenant's step is exactly what it would be alone,
    and no worker restarts or hangs. Then, on the same pair, a rank dies after a step
    (_rank_died_after_its_step)."""
    d = slow_pair
    keys = {t: make_key(d.data_dir, t) for t in ("good", "bad")}
    sc = {t: tinker.ServiceClient(base_url=d.url, api_key=k) for t, k in keys.items()}
    good, control = (sc["good"].create_lora_training_client(
        base_model=tiny_dir.name, rank=4, seed=21).result(timeout=T) for _ in range(2))
    bad = sc["bad"].create_lora_training_client(base_model=tiny_dir.name, rank=4,
                                               seed=22).result(timeout=T)
    data = _data(good.get_tokenizer())
    _step(control, data)
    want = _flat(_logprobs(control, data))
    restarts = d.metric("twinkle_worker_restarts_total")

    slow = hold_workers(good, data)
    fut_good = good.forward_backward(data, "cross_entropy")  # ... so these three
    fut_opt = good.optim_step(tinker.types.AdamParams(learning_rate=1e-2))  # share
    fut_bad = bad.forward_backward(POISON, "cross_entropy")  # the next step
    slow.result(timeout=T)
    assert fut_good.result(timeout=T).metrics["loss:sum"] > 0
    assert fut_opt.result(timeout=T) is not None
    with pytest.raises(tinker.RequestFailedError, match="failed in the engine"):
        fut_bad.result(timeout=T)
    assert _flat(_logprobs(good, data)) == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert d.metric("twinkle_worker_restarts_total") == restarts
    assert _fb(bad, data).metrics["loss:sum"] > 0  # the bad tenant goes on
    _rank_died_after_its_step(d, tiny_dir)


def _rank_died_after_its_step(d, tiny_dir) -> None:
    """Two data-parallel ranks; a step holds a forward_backward and its optim_step, and
    rank 1 dies after it without answering (injected), while rank 0 answered and persists
    the state after it. The step failed (server), so that state was never acknowledged:
    the restarted group must restore the state before it. Redone, the run lands exactly
    where a twin's two steps did (restored from rank 0's version, the optim_step would
    count twice)."""
    key = make_key(d.data_dir, "ann")
    trigger = d.data_dir / "die-after-optim"
    sc = tinker.ServiceClient(base_url=d.url, api_key=key)
    tc, twin = (sc.create_lora_training_client(base_model=tiny_dir.name, rank=4,
                                               seed=9).result(timeout=T) for _ in range(2))
    data = _data(tc.get_tokenizer())
    for c in (twin, twin, tc):
        _step(c, data, 5e-2)
    want = _flat(_logprobs(twin, data))

    old = d.workers()
    trigger.touch()
    slow = hold_workers(tc, data)
    fut_fb = tc.forward_backward(data, "cross_entropy")  # these two share the next step
    fut_opt = tc.optim_step(tinker.types.AdamParams(learning_rate=5e-2))
    slow.result(timeout=T)
    with pytest.raises(tinker.RequestFailedError, match="restarted"):
        fut_fb.result(timeout=T)
    with pytest.raises(tinker.RequestFailedError):
        fut_opt.result(timeout=T)
    assert not trigger.exists()  # rank 1 did die after that step
    d.wait_workers(2, old=set(old))
    _step(tc, data, 5e-2)  # the client redoes both
    assert _flat(_logprobs(tc, data)) == pytest.approx(want, rel=1e-4, abs=1e-5)
