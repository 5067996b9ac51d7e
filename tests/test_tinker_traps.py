"""The compatibility traps of the Tinker reference (section 11.4), each checked on the wire."""

from __future__ import annotations

import time

import httpx
import pytest

tinker = pytest.importorskip("tinker")
pb = pytest.importorskip("tinker.proto.tinker_public_pb2")


@pytest.fixture()
def http(daemon):
    with httpx.Client(base_url=f"{daemon.url}/api/v1", timeout=60,
                      headers={"X-API-Key": daemon.keys["alice"]}) as c:
        yield c


def new_model(http, tiny_dir, rank=4):
    sid = http.post("/create_session", json={"tags": [], "user_metadata": {},
                                             "sdk_version": "0.38.0"}).json()["session_id"]
    r = http.post("/create_model", json={"session_id": sid, "model_seq_id": 0,
                                         "base_model": tiny_dir.name,
                                         "lora_config": {"rank": rank}, "type": "create_model"})
    return sid, r


def poll(http, request_id):
    while True:
        r = http.post("/retrieve_future", json={"request_id": request_id,
                                                "allow_metadata_only": False})
        if r.headers["content-type"].startswith("application/json") and \
                r.json().get("type") == "try_again":
            continue
        return r


def test_1_client_config_exists(http):
    r = http.post("/client/config", json={"sdk_version": "0.38.0"})
    assert r.status_code == 200
    # What the client acts on: the daemon's chunk length (2 in the session daemon's
    # config), no zstd bodies, no pyqwest transport.
    assert r.json() == {"fwdbwd_max_chunk_len": 2, "proto_compress_fwdbwd": False,
                        "use_pyqwest_transport": False}


def test_2_and_7_request_ids_are_strings_and_model_ids_follow_the_sdk(http, tiny_dir):
    sid, r = new_model(http, tiny_dir)
    body = r.json()
    assert isinstance(body["request_id"], str)
    result = poll(http, body["request_id"]).json()
    assert result["model_id"] == f"{sid}:train:0"


def test_4_and_6_results_are_protobuf_and_metric_keys_have_a_reduction(http, tiny_dir, daemon):
    sc = tinker.ServiceClient(base_url=daemon.url, api_key=daemon.keys["alice"])
    tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=4).result(timeout=60)
    d = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([5, 6, 7]),
                           loss_fn_inputs={"target_tokens": [6, 7, 8]})
    fut = tc.forward_backward([d], "cross_entropy")
    out = fut.result(timeout=60)  # the client accepts only protobuf here
    assert all(k.count(":") == 1 for k in out.metrics)
    opt = tc.optim_step(tinker.types.AdamParams()).result(timeout=60)
    assert all(k.count(":") == 1 for k in opt.metrics)


def test_5_asample_returns_sample_sequence_ids(http, tiny_dir):
    sid = http.post("/create_session", json={}).json()["session_id"]
    sampler = http.post("/create_sampling_session", json={
        "session_id": sid, "sampling_session_seq_id": 0, "base_model": tiny_dir.name}).json()
    r = http.post("/asample", json={
        "num_samples": 3, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]},
        "sampling_params": {"max_tokens": 2, "temperature": 0.0},
        "sampling_session_id": sampler["sampling_session_id"], "seq_id": 0, "type": "sample"})
    body = r.json()
    assert len(body["sample_sequence_ids"]) == 3 and len(set(body["sample_sequence_ids"])) == 3
    assert poll(http, body["request_id"]).headers["content-type"] == "application/x-protobuf"


def test_8_finish_session(http):
    sid = http.post("/create_session", json={}).json()["session_id"]
    assert http.post(f"/sessions/{sid}/finish", json={"reason": {"type": "success"}}).status_code == 204
    # A finished session's heartbeat says so (410 stops the client's loop).
    assert http.post("/session_heartbeat", json={"session_id": sid}).status_code == 410


def test_9_polls_are_held_then_try_again(http, tiny_dir):
    """An op waiting on a seq_id gap stays pending: the poll is held, then try_again. A
    poll held while the gap fills is answered with the result, not try_again."""
    from concurrent.futures import ThreadPoolExecutor

    sid, r = new_model(http, tiny_dir)
    poll(http, r.json()["request_id"])
    model_id = f"{sid}:train:0"
    late = http.post("/optim_step", json={"model_id": model_id, "seq_id": 2,
                                          "adam_params": {"learning_rate": 1e-3}}).json()
    r = http.post("/retrieve_future", json={"request_id": late["request_id"]})
    assert r.json()["type"] == "try_again" and r.json()["queue_state"] == "active"
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(http.post, "/retrieve_future",
                           json={"request_id": late["request_id"]})
        time.sleep(0.2)  # the poll is in; now the gap fills and seq_id 2 runs
        http.post("/optim_step", json={"model_id": model_id, "seq_id": 1,
                                       "adam_params": {"learning_rate": 1e-3}})
        answer = held.result(timeout=60)
    assert answer.headers["content-type"].startswith("application/json")
    assert answer.json().get("type") != "try_again"  # woken by the result, while held


def test_10_permanent_failures_are_never_5xx_408_or_409(http, tiny_dir):
    sid, r = new_model(http, tiny_dir)
    poll(http, r.json()["request_id"])
    again = http.post("/create_model", json={"session_id": sid, "model_seq_id": 0,
                                             "base_model": tiny_dir.name, "lora_config": {}})
    assert again.status_code == 400 and "already" in again.json()["detail"]
    assert http.post("/create_session", content=b"{not json").status_code == 400
    wrong = http.post("/create_model", json={"session_id": sid, "model_seq_id": 1,
                                             "base_model": "someone/else", "lora_config": {}})
    assert wrong.status_code == 400 and "not served here" in wrong.json()["detail"]
    # Bad values are refused at the door, naming the field; the refusal takes its seq_id,
    # so the client's next request (seq_id 2) runs rather than waiting for seq_id 1.
    model_id = f"{sid}:train:0"
    bad = http.post("/optim_step", json={"model_id": model_id, "seq_id": 1,
                                         "adam_params": {"learning_rate": -1.0}})
    assert bad.status_code == 400 and "adam_params.learning_rate" in bad.json()["detail"]
    nxt = http.post("/optim_step", json={"model_id": model_id, "seq_id": 2,
                                         "adam_params": {"learning_rate": 1e-3}}).json()
    res = poll(http, nxt["request_id"])
    assert res.status_code == 200 and "error" not in res.json()


def test_retried_seq_id_returns_the_original_future(http, tiny_dir):
    sid, r = new_model(http, tiny_dir)
    poll(http, r.json()["request_id"])
    body = {"model_id": f"{sid}:train:0", "seq_id": 1, "adam_params": {"learning_rate": 1e-3}}
    first = http.post("/optim_step", json=body).json()["request_id"]
    second = http.post("/optim_step", json=body).json()["request_id"]
    assert first == second


def test_unauthenticated_requests_are_refused(daemon):
    for headers in ({}, {"X-API-Key": "tml-not-a-key"}):
        r = httpx.post(f"{daemon.url}/api/v1/create_session", json={}, headers=headers)
        assert r.status_code == 401
    assert httpx.get(f"{daemon.url}/api/v1/healthz").json()["status"] == "ok"


def test_zstd_compressed_forward_backward_bodies_are_accepted(http, tiny_dir):
    import struct

    import zstandard

    sid, r = new_model(http, tiny_dir)
    poll(http, r.json()["request_id"])
    req = pb.ForwardBackwardRequest(model_id=f"{sid}:train:0", seq_id=1, loss_fn="cross_entropy")
    d = req.data.add()
    d.model_input.add().encoded_text.tokens = struct.pack("<3i", 5, 6, 7)
    t = d.loss_fn_inputs["target_tokens"]
    t.dtype, t.dense = pb.DTYPE_INT64, struct.pack("<3q", 6, 7, 8)
    t.shape.append(3)
    body = zstandard.ZstdCompressor().compress(req.SerializeToString())
    r = http.post("/forward_backward", content=body, headers={
        "Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"})
    assert r.status_code == 200, r.text
    res = poll(http, r.json()["request_id"])
    out = pb.ForwardBackwardOutput.FromString(res.content)
    assert out.metrics["loss:sum"] > 0


def test_unsupported_features_are_refused_by_name(daemon, tiny_dir):
    sc = tinker.ServiceClient(base_url=daemon.url, api_key=daemon.keys["alice"])
    tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=4).result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="age-encrypted external weights are not "
                       "supported"):
        tc.save_weights_external("x", age_encryption_recipients=["age1x"]).result(timeout=60)
