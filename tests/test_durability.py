"""Acknowledged means durable: after a worker kill or a daemon SIGKILL, every adapter is at
the step its client was told is done, even when persisted state lags far behind (the
journal's ops after it are replayed, twinkled/core/journal.py), pending gradients included."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
from daemon import Daemon, make_key
from helpers import hold_workers, tinker_datums

tinker = pytest.importorskip("tinker")
T = 120
# A datum of 13 tokens makes a pass fail after its backward (TWINKLED_TEST_FAIL_TOKENS).
POISON = [tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([5] * 13),
                             loss_fn_inputs={"target_tokens": [6] * 13})]
TEXTS = ["the sun and the sea are big.", "a cat.", "one two three four five six seven"]


def _data(tok):
    return tinker_datums(tok, TEXTS)


def _fb(tc, data):
    return tc.forward_backward(data, "cross_entropy").result(timeout=T)


def _optim(tc, lr):
    return tc.optim_step(tinker.types.AdamParams(learning_rate=lr)).result(timeout=T)


def _logprobs(tc, data) -> list[float]:
    out = tc.forward(data, "cross_entropy").result(timeout=T)
    return [x for o in out.loss_fn_outputs for x in o["logprobs"].tolist()]


def _history(tc, data, lr):
    """Three acknowledged optimizer steps, then a forward_backward whose gradients are
    still pending (acknowledged too) when the crash comes."""
    for _ in range(3):
        _fb(tc, data)
        _optim(tc, lr)
    _fb(tc, data)


def _lagging(tiny_dir, tmp_path, extra: str = "", tenants=("ann", "ben", "cat", "dan"),
             env: dict | None = None):
    cfg = tmp_path / "twinkled.toml"
    cfg.write_text("persist_every = 1000\n" + extra)
    keys = {t: make_key(tmp_path, t) for t in tenants}
    d = Daemon(tiny_dir, tmp_path, tmp_path / "log1", "--config", str(cfg), env=env)
    d.keys, d.cfg = keys, cfg
    return d


@pytest.fixture()
def lagging(tiny_dir, tmp_path):
    """A daemon whose write-behind persistence runs only every 1000th step: a create writes
    no version (its seed makes it again), so everything a restore gets back comes from the
    seed and the journal."""
    d = _lagging(tiny_dir, tmp_path)
    yield d
    d.stop()


@pytest.fixture()
def lagging_hangs(tiny_dir, tmp_path):
    """`lagging`, and more: a step not answered within 10 s restarts the worker group, and
    no version is ever written (the writer waits 10 min first), so even a load, which
    asks for one at once, is covered by the journal alone."""
    d = _lagging(tiny_dir, tmp_path, "step_timeout_s = 10\n", tenants=("ann", "ben"),
                 env={"TWINKLED_TEST_PERSIST_DELAY": "600"})
    yield d
    d.stop(signal.SIGKILL)  # a clean stop would wait for the writer


def _clients(d, tiny_dir):
    made = {}
    for i, (tenant, key) in enumerate(d.keys.items()):
        sc = tinker.ServiceClient(base_url=d.url, api_key=key)
        made[tenant] = (sc.create_lora_training_client(base_model=tiny_dir.name, rank=4,
                                                       seed=10 + i).result(timeout=T),
                        sc.create_lora_training_client(base_model=tiny_dir.name, rank=4,
                                                       seed=10 + i).result(timeout=T))
    return made


def _expected(made, data):
    """Each tenant's control adapter (same seed) runs the same history and then the
    optimizer step that will follow the crash: what the restored adapter must reach."""
    want = {}
    for i, (tenant, (_, control)) in enumerate(made.items()):
        _history(control, data, 1e-2 * (i + 1))
        _optim(control, 1e-2 * (i + 1))
        want[tenant] = _logprobs(control, data)
    return want


def _check(made, data, want):
    for i, (tenant, (tc, _)) in enumerate(made.items()):
        _optim(tc, 1e-2 * (i + 1))  # applies the gradients pending at the crash
        got = _logprobs(tc, data)
        assert got == pytest.approx(want[tenant], rel=1e-4, abs=1e-5), tenant


def test_worker_kill_and_daemon_sigkill_keep_every_acknowledged_step(lagging, tiny_dir,
                                                                     tmp_path):
    """One lineage (one daemon start and one set of clients for both crashes): a worker
    kill, then more acknowledged history on the restored adapters, then a daemon SIGKILL;
    after each, every adapter is where its control twin is."""
    made = _clients(lagging, tiny_dir)
    data = _data(next(iter(made.values()))[0].get_tokenizer())
    for i, (tc, _) in enumerate(made.values()):
        _history(tc, data, 1e-2 * (i + 1))
    want = _expected(made, data)
    old = lagging.workers()
    os.kill(old[0], signal.SIGKILL)
    lagging.wait_workers(1, old=set(old))
    _check(made, data, want)
    assert "replayed" in lagging.log_path.read_text()

    # The daemon SIGKILL: the history since the worker restart comes from the journal.
    for i, (tc, _) in enumerate(made.values()):
        _history(tc, data, 1e-2 * (i + 1))
    want = _expected(made, data)
    lagging.stop(signal.SIGKILL)
    time.sleep(0.5)
    d2 = Daemon(tiny_dir, tmp_path, tmp_path / "log2", "--config", str(lagging.cfg),
                port=lagging.port)
    try:
        _check(made, data, want)  # the same clients, resumed on the same model ids
        assert "replayed" in (tmp_path / "log2").read_text()
    finally:
        d2.stop()


def test_a_hung_step_restarts_the_group_keeping_loads_and_saying_what_was_lost(
        lagging_hangs, tiny_dir):
    """A worker that stops answering (SIGSTOP) fails its step once `step_timeout_s` has
    passed and the group restarts. ann's acknowledged load_state survives it (the journal
    replays the load). ben's cannot: the checkpoint he loaded was deleted since, so its
    replay fails; his next request fails once, saying how many acknowledged operations
    were lost, and the one after runs."""
    d = lagging_hangs
    sc = {t: tinker.ServiceClient(base_url=d.url, api_key=d.keys[t]) for t in ("ann", "ben")}
    ann, ben = (sc[t].create_lora_training_client(base_model=tiny_dir.name, rank=4,
                                                  seed=5 + i).result(timeout=T)
                for i, t in enumerate(("ann", "ben")))
    data = _data(ann.get_tokenizer())
    paths = {}
    for name, tc in (("ann", ann), ("ben", ben)):
        _fb(tc, data)
        _optim(tc, 5e-2)
        paths[name] = tc.save_state(f"{name}-1").result(timeout=T).path
        _fb(tc, data)  # moves it away from the checkpoint ...
        _optim(tc, 5e-2)
        tc.load_state(paths[name]).result(timeout=T)  # ... and back (acknowledged)
    want = _logprobs(ann, data)
    tinker.RestClient(base_url=d.url, api_key=d.keys["ben"]).delete_checkpoint_from_tinker_path(
        paths["ben"]).result(timeout=T)
    restarts = _restarts(d)

    old = d.workers()
    os.kill(old[0], signal.SIGSTOP)  # hung: alive, silent
    try:
        with pytest.raises(tinker.RequestFailedError, match="did not answer within 10 s"):
            _fb(ann, data)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the restart has killed it, or will
            os.kill(old[0], signal.SIGCONT)
    d.wait_workers(1, old=set(old))
    assert _restarts(d) > restarts
    assert _logprobs(ann, data) == pytest.approx(want, rel=1e-4, abs=1e-5)
    with pytest.raises(tinker.RequestFailedError,
                       match=r"1 acknowledged operation\(s\) could not be replayed"):
        _fb(ben, data)
    assert _fb(ben, data).metrics["loss:sum"] > 0  # told once; then it goes on
    assert "could not be replayed" in d.log_path.read_text()


def _restarts(d) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"{d.url}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("twinkle_worker_restarts_total"))


@pytest.fixture(scope="module")
def faulty(tiny_dir, tmp_path_factory):
    """One worker whose steps take 0.6 s, and any pass over a datum of 13 tokens fails after
    its backward (injected). No joins (preempt_ms = 0): a request sent while a step is held
    waits for the next step, never joining the held one (tests/test_flood.py covers joins).
    Shared by the tests below, each with tenants of its own."""
    data_dir = tmp_path_factory.mktemp("faulty")
    cfg = data_dir / "twinkled.toml"
    cfg.write_text("preempt_ms = 0\n")
    d = Daemon(tiny_dir, data_dir, data_dir / "log", "--config", str(cfg), env={
        "TWINKLED_TEST_FAIL_TOKENS": "13", "TWINKLED_TEST_STEP_DELAY": "0.6"})
    yield d
    d.stop()


def test_a_failed_shared_pass_fails_only_the_request_at_fault(faulty, tiny_dir):
    """A pass that fails after its backward (injected: any datum of 13 tokens) leaves part
    of its gradients in every adapter it held. They are restored to their acknowledged
    state and the pass's requests run one at a time: the other tenant's request succeeds
    with exactly the gradients it would have had alone, no worker restarts."""
    d = faulty
    keys = {t: make_key(d.data_dir, t) for t in ("good", "bad")}
    sc = {t: tinker.ServiceClient(base_url=d.url, api_key=k) for t, k in keys.items()}
    good = sc["good"].create_lora_training_client(base_model=tiny_dir.name, rank=4,
                                                 seed=21).result(timeout=T)
    control = sc["good"].create_lora_training_client(base_model=tiny_dir.name, rank=4,
                                                    seed=21).result(timeout=T)
    bad = sc["bad"].create_lora_training_client(base_model=tiny_dir.name, rank=4,
                                               seed=22).result(timeout=T)
    data = _data(good.get_tokenizer())
    # Gradients already pending before the shared pass: counted twice or lost, they
    # would turn the step (AdamW's first step is blind to their overall scale).
    _fb(control, data[:1])
    _fb(control, data)
    _optim(control, 1e-2)
    _fb(good, data[:1])
    want = _logprobs(control, data)
    restarts = _restarts(d)

    slow = hold_workers(good, data)
    fut_good = good.forward_backward(data, "cross_entropy")  # ... so these two share
    fut_bad = bad.forward_backward(POISON, "cross_entropy")  # the next step
    slow.result(timeout=T)
    assert fut_good.result(timeout=T).metrics["loss:sum"] > 0
    with pytest.raises(tinker.RequestFailedError, match="failed in the engine"):
        fut_bad.result(timeout=T)
    _optim(good, 1e-2)
    assert _logprobs(good, data) == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert _restarts(d) == restarts
    assert "one at a time" in d.log_path.read_text()  # they did share a pass
    assert _fb(bad, data).metrics["loss:sum"] > 0  # the bad tenant goes on


def test_with_persistence_off_a_worker_kill_brings_an_adapter_back_as_created(tiny_dir,
                                                                             tmp_path):
    """persist_every = 0: no write-behind, no journal. A worker kill brings a run back at
    its creation state (its initial weights, as its seed made them), so one optimizer step
    after the kill lands exactly where a twin's first step did."""
    cfg = tmp_path / "twinkled.toml"
    cfg.write_text("persist_every = 0\n")
    key = make_key(tmp_path, "ann")
    d = Daemon(tiny_dir, tmp_path, tmp_path / "log", "--config", str(cfg))
    try:
        sc = tinker.ServiceClient(base_url=d.url, api_key=key)
        restored, twin = (sc.create_lora_training_client(
            base_model=tiny_dir.name, rank=4, seed=7).result(timeout=T) for _ in range(2))
        data = _data(twin.get_tokenizer())
        for tc in (twin, restored, restored):  # the restored one trains twice before the kill
            _fb(tc, data)
            _optim(tc, 5e-2)
        one_step = _logprobs(twin, data)
        old = d.workers()
        os.kill(old[0], signal.SIGKILL)
        d.wait_workers(1, old=set(old))
        _fb(restored, data)  # back at its initial state: one step must land where twin's did
        _optim(restored, 5e-2)
        assert _logprobs(restored, data) == pytest.approx(one_step, rel=1e-4, abs=1e-5)
    finally:
        d.stop()


def _run_and_twin(d, tiny_dir, tenant: str, seed: int):
    """A run, its twin (same seed) after one step, the data and the twin's logprobs."""
    sc = tinker.ServiceClient(base_url=d.url, api_key=make_key(d.data_dir, tenant))
    tc, twin = (sc.create_lora_training_client(base_model=tiny_dir.name, rank=4,
                                               seed=seed).result(timeout=T) for _ in range(2))
    data = _data(tc.get_tokenizer())
    _fb(twin, data)
    _optim(twin, 5e-2)
    return tc, twin, data, _logprobs(twin, data)


def test_an_optim_step_queued_behind_a_lost_forward_backward_fails_with_it(faulty, tiny_dir):
    """A pipelining client's optim_step waits behind its forward_backward when the worker
    running that forward_backward is killed. The gradients died with the worker, so the
    optim_step must fail too (category server: redo both), not be answered as done having
    applied nothing; redone, the run lands exactly where a twin's one step did."""
    d = faulty
    tc, twin, data, want = _run_and_twin(d, tiny_dir, "ann", 5)

    fut_fb = tc.forward_backward(data, "cross_entropy")
    time.sleep(0.25)  # its step is in the worker (held by the injected delay) ...
    fut_opt = tc.optim_step(tinker.types.AdamParams(learning_rate=5e-2))  # ... this waits
    time.sleep(0.2)
    old = d.workers()
    os.kill(old[0], signal.SIGKILL)
    with pytest.raises(tinker.RequestFailedError, match="restarted") as lost:
        fut_fb.result(timeout=T)
    assert str(lost.value.category) == "server"
    with pytest.raises(tinker.RequestFailedError, match="did not run") as skipped:
        fut_opt.result(timeout=T)
    assert str(skipped.value.category) == "server"
    d.wait_workers(1, old=set(old))
    _fb(tc, data)  # the client redoes both
    _optim(tc, 5e-2)
    assert _logprobs(tc, data) == pytest.approx(want, rel=1e-4, abs=1e-5)


def test_an_optim_step_that_arrives_after_its_forward_backward_failed_fails_too(faulty,
                                                                               tiny_dir):
    """The pipelined optim_step's request may reach the daemon only after the
    forward_backward ahead of it failed (a slow client, a loaded box: seen in CI's chaos
    test). It was still sent blind: it fails, applying nothing; the client's redo of the
    forward_backward clears the failure, and the run lands where a twin's one step did."""
    d = faulty
    tc, twin, data, want = _run_and_twin(d, tiny_dir, "late", 9)

    fut_fb = tc.forward_backward(POISON, "cross_entropy")  # fails in the engine ...
    _logprobs(twin, data)  # ... before this forward of another run is answered
    fut_opt = tc.optim_step(tinker.types.AdamParams(learning_rate=5e-2))  # then this arrives
    with pytest.raises(tinker.RequestFailedError, match="did not run") as skipped:
        fut_opt.result(timeout=T)
    with pytest.raises(tinker.RequestFailedError, match="failed in the engine") as failed:
        fut_fb.result(timeout=T)
    assert str(skipped.value.category) == str(failed.value.category)
    _fb(tc, data)  # the client redoes both
    _optim(tc, 5e-2)
    assert _logprobs(tc, data) == pytest.approx(want, rel=1e-4, abs=1e-5)
