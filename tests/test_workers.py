"""The worker group: torch stays out of the HTTP process, data parallelism computes what one
worker would, and killed workers or daemons lose nothing that was acknowledged."""

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

tinker = pytest.importorskip("tinker")
T = 120
TEXTS = ["the sun and the sea are big.", "a cat.", "one two three four five six seven",
         "blue green"]
# Rollouts of one long prompt (over shared_prefix's 32 tokens): one replica takes them all.
PROMPT = "the quick brown fox jumps over the lazy dog near the river bank at dawn, " * 3
ROLLOUTS = [PROMPT + end for end in ("and sleeps.", "then runs far away.", "and eats.")]
LONG = PROMPT * 2 + "the end."  # ~230 tokens: split over the ranks at --cp 2
CP_MIN = 200


def _data(tok, texts=TEXTS):
    out = []
    for text in texts:
        ids = tok(text).input_ids
        out.append(tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
                                      loss_fn_inputs={"target_tokens": ids[1:]}))
    return out


def _step(tc, data, lr=1e-2):
    out = tc.forward_backward(data, "cross_entropy").result(timeout=T)
    tc.optim_step(tinker.types.AdamParams(learning_rate=lr)).result(timeout=T)
    return out


def _logprobs(tc, data) -> list[list[float]]:
    out = tc.forward(data, "cross_entropy").result(timeout=T)
    return [o["logprobs"].tolist() for o in out.loss_fn_outputs]


def _checkpoint(data_dir, path: str) -> dict:
    """A saved checkpoint's tensors (weights and optimizer moments), by name."""
    from safetensors.torch import load_file

    from twinkled.store import Store

    store = Store(data_dir / "twinkle.db")
    directory = store.checkpoints.get(path)["dir"]
    store.close()
    tensors = {}
    for name in ("adapter_model.safetensors", "optimizer.safetensors"):
        tensors.update({f"{name}:{k}": v for k, v in load_file(f"{directory}/{name}").items()})
    return tensors


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_http_process_never_imports_torch(daemon):
    code = ("import sys, twinkled.server.cli, twinkled.server.app, twinkled.core.service, tinker_shim.routes, "
            "twinkled.core.executor, twinkled.core.engine_core, twinkled.workers.supervisor, scheduler; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    # The running daemon has not loaded torch's library; its worker has.
    maps = open(f"/proc/{daemon.proc.pid}/maps").read()
    assert "libtorch" not in maps
    workers = daemon.workers()
    assert len(workers) == 1
    assert "libtorch" in open(f"/proc/{workers[0]}/maps").read()


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
    d = Daemon(tiny_dir, data_dir, data_dir / "log", "--workers", "2", "--cp", "2",
               "--config", str(data_dir / "cp.toml"),
               env={"TWINKLED_TEST_STEP_DELAY": "1.0",
                    "TWINKLED_TRACE": str(data_dir / "trace.jsonl")})
    d.keys, d.trace = keys, data_dir / "trace.jsonl"
    yield d
    d.stop()


def _client(d, tenant, tiny_dir, seed):
    sc = tinker.ServiceClient(base_url=d.url, api_key=d.keys[tenant])
    return sc.create_lora_training_client(base_model=tiny_dir.name, rank=4,
                                          seed=seed).result(timeout=T)


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
        results[n] = (losses, _logprobs(tc, data), _checkpoint(d.data_dir, path))
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
    before = _checkpoint(slow_pair.data_dir, before_path)
    after = _checkpoint(slow_pair.data_dir, after_path)
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


def test_sigterm_is_a_hot_restart_and_sigkill_rolls_back_to_persisted_state(tiny_dir, tmp_path):
    """One lineage of daemons on one data dir, 2 worker ranks each. SIGTERM: the same
    TrainingClient carries on, on the same model id, with the exact weights. Then SIGKILL:
    the workers die with the daemon (no orphan holds a GPU), the run resumes from its
    persisted state, and a checkpoint damaged while the daemon was down is quarantined.
    The last daemon unloads idle adapters after 1 s (_idle_adapters_are_unloaded_and_
    come_back_on_their_next_request: its own daemon start less)."""
    key = make_key(tmp_path, "carol")
    d = Daemon(tiny_dir, tmp_path, tmp_path / "log1", "--workers", "2")
    sc = tinker.ServiceClient(base_url=d.url, api_key=key)
    tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=4,
                                        seed=5).result(timeout=T)
    data = _data(tc.get_tokenizer())
    _step(tc, data)
    _step(tc, data)
    want = _logprobs(tc, data)
    d.stop(signal.SIGTERM)
    assert d.proc.returncode == 0
    d = Daemon(tiny_dir, tmp_path, tmp_path / "log2", "--workers", "2", port=d.port)
    try:
        assert _logprobs(tc, data) == want
        _step(tc, data)
        assert _logprobs(tc, data) != want

        ckpt = tc.save_state("c1").result(timeout=T).path
        _step(tc, data)
        time.sleep(1.0)  # the write-behind persistence of the last step
        want = _logprobs(tc, data)
        workers = d.workers()
        d.stop(signal.SIGKILL)
        deadline = time.time() + 10
        while any(_alive(p) for p in workers) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in workers)  # they died with it: no orphan holds a GPU

        from twinkled.store import Store

        store = Store(tmp_path / "twinkle.db")
        directory = store.checkpoints.get(ckpt)["dir"]
        store.close()
        weights = f"{directory}/adapter_model.safetensors"
        raw = bytearray(open(weights, "rb").read())
        raw[-3] ^= 0xFF
        open(weights, "wb").write(raw)

        cfg = tmp_path / "idle.toml"
        cfg.write_text("idle_unload_s = 1.0\n")
        d = Daemon(tiny_dir, tmp_path, tmp_path / "log3", "--workers", "2", "--config",
                   str(cfg), port=d.port)
        assert _logprobs(tc, data) == want  # same client, same model id, resumed
        _step(tc, data)
        listed = subprocess.run(
            [sys.executable, "-m", "twinkled", "ctl", "--data-dir", str(tmp_path), "checkpoints",
             "list", "--status", "corrupt", "--json"], capture_output=True, text=True, check=True)
        assert ckpt in listed.stdout and "sha256" in listed.stdout
        assert not os.path.exists(directory)  # moved aside, never served
        with pytest.raises(Exception, match="corrupt"):
            sc.create_training_client_from_state(ckpt).result(timeout=T)
        _idle_adapters_are_unloaded_and_come_back_on_their_next_request(d, tc, data)
        sc.close("success").result(timeout=T)  # while the daemon is up: later, it retries ~30 s
    finally:
        d.stop()


def _idle_adapters_are_unloaded_and_come_back_on_their_next_request(d, tc, data) -> None:
    """`d` unloads an adapter idle for 1 s; `tc`'s comes back on its next request."""
    want = _logprobs(tc, data)
    deadline = time.time() + 30
    status = {}
    while time.time() < deadline:
        status = ctl_status(d.data_dir)  # polled: in this process
        # (the log line follows the unload that the status already counts)
        if status["adapters"] == 0 and "unloaded after" in d.log_path.read_text():
            break
        time.sleep(0.2)
    assert status["adapters"] == 0, "the idle adapter was not unloaded"
    assert "unloaded after" in d.log_path.read_text()
    # Its next request reloads it: same weights, and training (and seq_ids) go on.
    assert _logprobs(tc, data) == want
    _step(tc, data)
    assert _logprobs(tc, data) != want


def test_frames_from_outside_the_worker_group_are_ignored(slow_pair, tiny_dir):
    """A process that is not a rank of this group (an orphaned worker of a daemon that died,
    reconnecting to a port this daemon reuses) is ignored: its frames, readable or not,
    neither fail a step nor pass for a rank's answer."""
    import json as _json

    import msgspec
    import zmq

    from twinkled.protocol.frames import OutcomeF, ReplyF

    args = _json.loads(open(f"/proc/{slow_pair.workers()[0]}/cmdline").read()
                       .split("\0")[3])
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


def test_a_killed_lane_costs_only_its_own_tenants(tiny_dir, tmp_path):
    """Two lanes of one CPU worker each: alice's model on lane 0, bob's on lane 1 (placed
    in turn). Lane 1's worker killed mid-step fails bob's step only; alice's, in the same
    moment on lane 0, completes; lane 1 restarts with bob's adapter and both go on."""
    keys = {t: make_key(tmp_path, t) for t in ("alice", "bob")}
    d = Daemon(tiny_dir, tmp_path, tmp_path / "log", "--workers", "2", "--lanes", "2",
               env={"TWINKLED_TEST_STEP_DELAY": "1.0"})
    d.keys = keys
    try:
        alice = _client(d, "alice", tiny_dir, 5)
        bob = _client(d, "bob", tiny_dir, 6)
        data = _data(alice.get_tokenizer())[:2]
        _step(alice, data)
        _step(bob, data)
        status = json.loads(subprocess.run(
            [sys.executable, "-m", "twinkled", "ctl", "--data-dir", str(tmp_path), "status",
             "--json"], capture_output=True, text=True, check=True).stdout)
        assert [lane["adapters"] for lane in status["lanes"]] == [1, 1]
        lane1 = next(w["pid"] for w in status["workers"] if w["lane"] == 1)
        old = d.workers()
        fa = alice.forward_backward(data, "cross_entropy")
        fb = bob.forward_backward(data, "cross_entropy")
        time.sleep(0.5)  # both lanes mid-step
        os.kill(lane1, signal.SIGKILL)
        with pytest.raises(tinker.RequestFailedError, match="restarted"):
            fb.result(timeout=T)
        assert fa.result(timeout=T).metrics["loss:sum"] > 0
        pids = d.wait_workers(2, old={lane1})
        assert set(old) - {lane1} <= set(pids)  # lane 0's worker was never restarted
        assert _step(bob, data).metrics["loss:sum"] > 0
        assert _step(alice, data).metrics["loss:sum"] > 0
        # Sampling: from bob's weights (on bob's lane) and from the base model (any lane).
        prompt = tinker.types.ModelInput.from_ints(alice.get_tokenizer()("a cat").input_ids)
        params = tinker.types.SamplingParams(max_tokens=3, temperature=0.0)
        sampler = bob.save_weights_and_get_sampling_client().result(timeout=T)
        assert len(sampler.sample(prompt, 1, params).result(timeout=T).sequences[0].tokens) == 3
        base = tinker.ServiceClient(base_url=d.url, api_key=keys["alice"]) \
            .create_sampling_client(base_model=tiny_dir.name).result(timeout=T)
        for _ in range(2):  # base-model samples take turns over the lanes
            assert len(base.sample(prompt, 1, params).result(timeout=T).sequences[0].tokens) == 3
    finally:
        d.stop()
