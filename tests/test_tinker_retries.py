"""A client that retries (it lost the answer) gets the original request, and nothing it asked
for is lost or done twice: saves, creates, refusals at the door, drains, crashes (issue 28
items 2-6, issue 30 item 2). Driven by the `tinker` client and, where a retry must resend the
very same body, raw HTTP with the client's key."""

from __future__ import annotations

import json
import signal
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from daemon import Daemon, make_key, run_ctl

tinker = pytest.importorskip("tinker")
T = 120


@pytest.fixture()
def http(daemon):
    with httpx.Client(base_url=f"{daemon.url}/api/v1", timeout=60,
                      headers={"X-API-Key": daemon.keys["alice"]}) as c:
        yield c


@pytest.fixture()
def sc(daemon):
    return tinker.ServiceClient(base_url=daemon.url, api_key=daemon.keys["alice"])


@pytest.fixture()
def rest(daemon):
    return tinker.RestClient(base_url=daemon.url, api_key=daemon.keys["alice"])


def ctl(data_dir, *args: str) -> str:
    """`twinkled ctl --data-dir DIR ARGS`'s output (ctl's own code in this process)."""
    return run_ctl(data_dir, *args).stdout


def poll(http: httpx.Client, request_id: str) -> dict:
    while True:
        r = http.post("/retrieve_future", json={"request_id": request_id})
        body = r.json()
        if body.get("type") != "try_again":
            return body


def new_model(http: httpx.Client, tiny_dir, rank: int = 4) -> str:
    sid = http.post("/create_session", json={}).json()["session_id"]
    r = http.post("/create_model", json={"session_id": sid, "model_seq_id": 0,
                                         "base_model": tiny_dir.name,
                                         "lora_config": {"rank": rank}})
    return poll(http, r.json()["request_id"])["model_id"]


def save(http: httpx.Client, route: str, model: str, seq: int, name: str, **extra) -> str:
    r = http.post(f"/{route}", json={"model_id": model, "seq_id": seq, "path": name, **extra})
    assert r.status_code == 200, r.text
    return r.json()["request_id"]


def sample_from(sc, path: str) -> list[int]:
    out = sc.create_sampling_client(model_path=path).result(timeout=T).sample(
        tinker.types.ModelInput.from_ints([5, 6]), 1,
        tinker.types.SamplingParams(max_tokens=2, temperature=0.0)).result(timeout=T)
    return out.sequences[0].tokens


def _data(tc):
    ids = tc.get_tokenizer()("the sun and the sea are big.").input_ids
    return [tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": ids[1:]})]


def test_a_retried_save_is_the_original_request_and_leaves_the_checkpoint_ready(
        http, sc, rest, tiny_dir):
    model = new_model(http, tiny_dir)
    first = save(http, "save_weights_for_sampler", model, 1, "s")
    path = poll(http, first)["path"]
    # The client lost the answer and sends the same request again: the same future, and the
    # checkpoint it made stays ready (before: flipped to "writing" for good, 404 not ready).
    assert save(http, "save_weights_for_sampler", model, 1, "s") == first
    assert poll(http, first)["path"] == path
    assert len(sample_from(sc, path)) == 2
    # save_weights with overwrite, retried, likewise.
    w = save(http, "save_weights", model, 2, "w", overwrite=True)
    wpath = poll(http, w)["path"]
    assert save(http, "save_weights", model, 2, "w", overwrite=True) == w
    assert rest.get_weights_info_by_tinker_path(wpath).result(timeout=T).lora_rank == 4
    sc.create_training_client_from_state(wpath).result(timeout=T)
    # A save sent with a seq_id another op took answers that op and records nothing.
    assert save(http, "save_weights", model, 2, "other") == w
    listed = {c.tinker_path for c in rest.list_checkpoints(model).result(timeout=T).checkpoints}
    assert listed == {path, wpath}


def test_concurrent_identical_saves_all_get_the_original_future(http, sc, tiny_dir):
    model = new_model(http, tiny_dir)
    with ThreadPoolExecutor(10) as pool:
        ids = list(pool.map(lambda _: save(http, "save_weights", model, 1, "c"), range(10)))
    assert len(set(ids)) == 1  # before: 9 of 10 got 400 "being written right now"
    path = poll(http, ids[0])["path"]
    assert save(http, "save_weights", model, 1, "c") == ids[0]  # after it finished, too
    sc.create_training_client_from_state(path).result(timeout=T)


def test_a_queued_save_does_not_hide_the_version_it_replaces(http, sc, rest, tiny_dir):
    model = new_model(http, tiny_dir)
    path = poll(http, save(http, "save_weights_for_sampler", model, 1, "q"))["path"]
    old = {c.tinker_path: c for c in rest.list_checkpoints(model).result(timeout=T).checkpoints}
    # A new version queued behind a seq_id gap (2 has not come): the old one is still served.
    pending = save(http, "save_weights_for_sampler", model, 3, "q")
    listed = rest.list_checkpoints(model).result(timeout=T).checkpoints
    assert [c.tinker_path for c in listed] == [path]
    assert len(sample_from(sc, path)) == 2
    step = http.post("/optim_step", json={"model_id": model, "seq_id": 2,
                                          "adam_params": {"learning_rate": 1e-3}})
    assert "error" not in poll(http, step.json()["request_id"])
    assert poll(http, pending)["path"] == path  # written now: the new version replaced it
    new = rest.list_checkpoints(model).result(timeout=T).checkpoints
    assert [c.tinker_path for c in new] == [path] and new[0].time > old[path].time
    assert len(sample_from(sc, path)) == 2


def test_identical_create_model_retries_get_the_original_future(http, tiny_dir):
    sid = http.post("/create_session", json={}).json()["session_id"]
    body = {"session_id": sid, "model_seq_id": 0, "base_model": tiny_dir.name,
            "lora_config": {"rank": 4}}

    def create(_):
        r = http.post("/create_model", json=body)
        assert r.status_code == 200, r.text
        return r.json()["request_id"]

    with ThreadPoolExecutor(30) as pool:
        ids = set(pool.map(create, range(30)))
    assert len(ids) == 1  # before: 29 of 30 got 400 "already exists"
    (first,) = ids
    assert poll(http, first)["model_id"] == f"{sid}:train:0"
    assert create(0) == first
    # Another request for the same id is not a retry: refused, naming it.
    other = http.post("/create_model", json={**body, "lora_config": {"rank": 8}})
    assert other.status_code == 400 and "already exists" in other.json()["detail"]


def test_a_retried_create_sampling_session_gets_the_sampler_it_made(http, tiny_dir):
    model = new_model(http, tiny_dir)
    path = poll(http, save(http, "save_weights_for_sampler", model, 1, "x"))["path"]
    sid = model.split(":train:")[0]
    body = {"session_id": sid, "sampling_session_seq_id": 3, "model_path": path}
    first = http.post("/create_sampling_session", json=body)
    again = http.post("/create_sampling_session", json=body)  # before: 400 "already used"
    assert again.status_code == 200, again.text
    assert again.json()["sampling_session_id"] == first.json()["sampling_session_id"]
    other = http.post("/create_sampling_session", json={
        "session_id": sid, "sampling_session_seq_id": 3, "base_model": tiny_dir.name})
    assert other.status_code == 400 and "already used" in other.json()["detail"]


def test_names_with_dot_dot_are_refused_at_the_door(http, tiny_dir):
    """Before: they passed the door, then making the path failed: a 500 the client retries
    forever, and no seq_id taken, so its next request waited for good."""
    model = new_model(http, tiny_dir)
    routes = ("save_weights", "save_weights_for_sampler", "save_weights_external")
    for seq, (route, name) in enumerate(zip(routes, ("a..b", "x..", "a..b"), strict=True), 1):
        r = http.post(f"/{route}", json={"model_id": model, "seq_id": seq, "path": name})
        assert r.status_code == 400 and "path" in r.json()["detail"], r.text
    # Each refusal took its seq_id: the client's next request runs.
    nxt = http.post("/optim_step", json={"model_id": model, "seq_id": 4,
                                         "adam_params": {"learning_rate": 1e-3}})
    assert "error" not in poll(http, nxt.json()["request_id"])


def test_weights_info_of_a_deleted_runs_checkpoint(daemon, sc, rest, tiny_dir):
    tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=4).result(timeout=T)
    path = tc.save_state("kept").result(timeout=T).path
    ctl(daemon.data, "runs", "delete", tc.model_id)  # the run goes, its checkpoints stay
    info = rest.get_weights_info_by_tinker_path(path).result(timeout=T)
    assert info.lora_rank == 4 and info.base_model


def _count(url: str, series: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(series + " "):
                return float(line.split()[-1])
    return 0.0


def test_a_create_refused_by_a_drain_succeeds_on_the_sdks_retry(daemon, sc, tiny_dir):
    refused = 'twinkle_requests_total{route="/api/v1/create_model",status="503"}'
    before = _count(daemon.url, refused)
    ctl(daemon.data, "drain", "--timeout", "30")
    made: dict = {}
    try:
        worker = threading.Thread(target=lambda: made.update(tc=sc.create_lora_training_client(
            base_model=tiny_dir.name, rank=4)))
        worker.start()
        while _count(daemon.url, refused) <= before:  # the SDK heard 503 and retries
            worker.join(0.2)
    finally:
        ctl(daemon.data, "drain", "--undo")
    worker.join(T)
    tc = made["tc"].result(timeout=T)  # before: 400 "already exists" on the retry
    tc.forward_backward(_data(tc), "cross_entropy").result(timeout=T)
    session = tc.model_id.rsplit(":train:", 1)[0]
    runs = json.loads(ctl(daemon.data, "runs", "list", "--json"))
    assert [r["id"] for r in runs if r["id"].startswith(session + ":")] == [tc.model_id]


def _unloaded(log, model: str) -> None:
    """Wait until the daemon logging to `log` unloaded `model` as idle."""
    while f"adapter {model} unloaded after" not in log.read_text():
        threading.Event().wait(0.2)


def _idle_before_the_crash(d: Daemon, key: str, base_model: str) -> dict:
    """A run with an acknowledged optim_step (its seq_id and the logprobs after it), then
    unloaded while idle: the client will resend that step after the crash."""
    sc = tinker.ServiceClient(base_url=d.url, api_key=key)
    tc = sc.create_lora_training_client(base_model=base_model, rank=4).result(timeout=T)
    data, adam = _data(tc), tinker.types.AdamParams(learning_rate=1e-2)
    tc.forward_backward(data, "cross_entropy").result(timeout=T)
    tc.optim_step(adam).result(timeout=T)
    was = {"tc": tc, "data": data, "seq": tc._request_id_counter,  # that optim_step's
           "before": tc.forward(data, "cross_entropy").result(timeout=T).loss_fn_outputs}
    _unloaded(d.log_path, tc.model_id)
    return was


def _saves_before_the_crash(d: Daemon, key: str, base_model: str) -> dict:
    """A live run with a save retried, and one queued behind a gap when the crash comes."""
    sc = tinker.ServiceClient(base_url=d.url, api_key=key)
    tc = sc.create_lora_training_client(base_model=base_model, rank=4).result(timeout=T)
    data, adam = _data(tc), tinker.types.AdamParams(learning_rate=1e-2)
    tc.forward_backward(data, "cross_entropy").result(timeout=T)
    tc.optim_step(adam).result(timeout=T)
    path = tc.save_weights_for_sampler("s").result(timeout=T).path
    seq = tc._request_id_counter  # the seq_id the client gave that save
    with httpx.Client(base_url=f"{d.url}/api/v1", timeout=60,
                      headers={"X-API-Key": key}) as http:
        poll(http, save(http, "save_weights_for_sampler", tc.model_id, seq, "s"))
        save(http, "save_weights_for_sampler", tc.model_id, seq + 2, "s")  # waits: gap
    return {"sc": sc, "tc": tc, "data": data, "path": path}


def _failed_before_the_crash(d: Daemon, key: str, base: str) -> dict:
    """A run whose last forward_backward failed in the engine (its client heard)."""
    sc = tinker.ServiceClient(base_url=d.url, api_key=key)
    tc = sc.create_lora_training_client(base_model=base, rank=4, seed=3).result(timeout=T)
    data = _data(tc)
    before = tc.forward(data, "cross_entropy").result(timeout=T).loss_fn_outputs
    poison = [tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([5] * 13),
                                 loss_fn_inputs={"target_tokens": [6] * 13})]
    with pytest.raises(tinker.RequestFailedError, match="failed in the engine"):
        tc.forward_backward(poison, "cross_entropy").result(timeout=T)
    return {"tc": tc, "data": data, "before": [o["logprobs"].tolist() for o in before]}


def test_after_a_crash_retried_steps_and_saves_and_idle_unloaded_runs_resume(
        tiny_dir, tmp_path):
    """One SIGKILL and restart, two clients (one daemon lineage for both: a start each
    less).

    erin lost the answer of an optim_step that ran before the crash and resends it (same
    seq_id) while the restarted daemon is still starting: the original answer comes back
    and the run's weights do not move. Her run was unloaded while idle before the crash, so
    the request reloads it while the daemon restores what was live (dora's run). Before:
    the run was restored twice and requests queued on the first copy were never answered,
    or, answered, the retried step ran a second time.

    dora's run, live at the crash, is restored, unloaded while her client is away, and her
    client's next request (its own next seq_id) is answered. Saves retried before the
    crash, and one queued behind a gap when it came, leave the checkpoint they replace
    ready across the restart.

    fay's forward_backward failed (injected: a datum of 13 tokens) before the crash, and
    the optim_step her client sent behind it never reached that daemon: resent to the new
    one, it fails (its gradients are not there) rather than be answered done having
    applied nothing; her redo of both trains."""
    cfg = tmp_path / "twinkled.toml"
    cfg.write_text("idle_unload_s = 1.0\n")
    keys = {t: make_key(tmp_path, t) for t in ("dora", "erin", "fay")}
    env = {"TWINKLED_TEST_FAIL_TOKENS": "13"}
    d = Daemon(tiny_dir, tmp_path, tmp_path / "log1", "--config", str(cfg), env=env)
    try:
        erin = _idle_before_the_crash(d, keys["erin"], tiny_dir.name)
        dora = _saves_before_the_crash(d, keys["dora"], tiny_dir.name)
        fay = _failed_before_the_crash(d, keys["fay"], tiny_dir.name)
    except BaseException:
        d.stop()
        raise
    d.stop(signal.SIGKILL)

    log = tmp_path / "log2"
    d2 = Daemon(tiny_dir, tmp_path, log, "--config", str(cfg), port=d.port, wait=False,
                env=env)
    try:
        while d2.health() is None:  # answering HTTP, the workers still loading the model
            threading.Event().wait(0.05)
        tc = erin["tc"]
        with httpx.Client(base_url=f"{d2.url}/api/v1", timeout=60,
                          headers={"X-API-Key": keys["erin"]}) as http:
            while True:  # a 503 while the daemon starts, retried as the SDK does
                r = http.post("/optim_step", json={"model_id": tc.model_id,
                                                   "seq_id": erin["seq"],
                                                   "adam_params": {"learning_rate": 1e-2}})
                if r.status_code != 503:
                    break
                threading.Event().wait(0.2)
            assert r.status_code == 200, r.text
            assert poll(http, r.json()["request_id"]).get("type") != "RequestFailedResponse"
        d2.wait_ready()
        after = tc.forward(erin["data"], "cross_entropy").result(timeout=T).loss_fn_outputs
        assert [o["logprobs"].tolist() for o in after] == \
            [o["logprobs"].tolist() for o in erin["before"]]  # nothing ran twice
        adam = tinker.types.AdamParams(learning_rate=1e-2)
        tc.forward_backward(erin["data"], "cross_entropy").result(timeout=T)  # and it goes on
        tc.optim_step(adam).result(timeout=T)

        tc = dora["tc"]
        assert len(sample_from(dora["sc"], dora["path"])) == 2  # before: "marked corrupt"
        _unloaded(log, tc.model_id)  # the client is away past idle_unload_s
        # While the daemon is drained, a request for the unloaded run is refused (503, no
        # seq_id taken) without reloading its adapter for nothing.
        ctl(tmp_path, "drain", "--timeout", "30")
        open_models = json.loads(ctl(tmp_path, "status", "--json"))["adapters"]
        with httpx.Client(base_url=f"{d2.url}/api/v1",
                          headers={"X-API-Key": keys["dora"]}) as http:
            r = http.post("/optim_step", json={"model_id": tc.model_id,
                                               "seq_id": tc._request_id_counter + 1,
                                               "adam_params": {"learning_rate": 1e-2}})
        assert r.status_code == 503
        assert json.loads(ctl(tmp_path, "status", "--json"))["adapters"] == open_models
        ctl(tmp_path, "drain", "--undo")
        out = tc.forward_backward(dora["data"], "cross_entropy").result(timeout=T)  # before: hung
        assert out.metrics["loss:sum"] > 0
        tc.optim_step(adam).result(timeout=T)

        tc = fay["tc"]
        with pytest.raises(tinker.RequestFailedError, match="did not run") as lost:
            tc.optim_step(adam).result(timeout=T)
        assert str(lost.value.category) == "user"  # as its forward_backward's failure
        tc.forward_backward(fay["data"], "cross_entropy").result(timeout=T)
        tc.optim_step(adam).result(timeout=T)
        moved = tc.forward(fay["data"], "cross_entropy").result(timeout=T).loss_fn_outputs
        assert [o["logprobs"].tolist() for o in moved] != fay["before"]  # the redo trained
    finally:
        d2.stop()
