"""Each key is a tenant: another tenant's ids are not found, on every route that takes one."""

from __future__ import annotations

import struct

import httpx
import pytest

tinker = pytest.importorskip("tinker")
pb = pytest.importorskip("tinker.proto.tinker_public_pb2")


def fwdbwd_body(model_id: str, seq_id: int, tokens: list[int]) -> bytes:
    req = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    d = req.data.add()
    d.model_input.add().encoded_text.tokens = struct.pack(f"<{len(tokens) - 1}i", *tokens[:-1])
    t = d.loss_fn_inputs["target_tokens"]
    t.dtype = pb.DTYPE_INT64
    t.shape.append(len(tokens) - 1)
    t.dense = struct.pack(f"<{len(tokens) - 1}q", *tokens[1:])
    return req.SerializeToString()


@pytest.fixture(scope="module")
def alices(daemon, tiny_dir):
    """Alice's session, run, checkpoints, sampler and a finished future."""
    sc = tinker.ServiceClient(base_url=daemon.url, api_key=daemon.keys["alice"])
    tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=4).result(timeout=60)
    d = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([5, 6, 7]),
                           loss_fn_inputs={"target_tokens": [6, 7, 8]})
    tc.forward_backward([d], "cross_entropy").result(timeout=60)
    weights = tc.save_state("alice-w").result(timeout=60).path
    sampler_path = tc.save_weights_for_sampler("alice-s").result(timeout=60).path
    session = tc.model_id.split(":train:")[0]
    with httpx.Client(base_url=f"{daemon.url}/api/v1",
                      headers={"X-API-Key": daemon.keys["alice"]}) as http:
        sampler = http.post("/create_sampling_session", json={
            "session_id": session, "sampling_session_seq_id": 99,
            "model_path": sampler_path}).json()["sampling_session_id"]
        fut = http.post("/optim_step", json={"model_id": tc.model_id, "seq_id": 4,
                                             "adam_params": {}}).json()["request_id"]
    return {"session": session, "run": tc.model_id, "weights": weights,
            "sampler_path": sampler_path, "sampler": sampler, "future": fut}


@pytest.fixture(scope="module")
def bobs_tries(daemon, alices, tiny_dir) -> list[tuple[str, str, int, str]]:
    """Bob's attempts on every route that takes one of alice's ids: (method, path, status,
    body). A fixture, so alice's objects are checked after them whatever tests run."""
    a = alices
    run, ck = a["run"], "weights/alice-w"
    calls = [
        ("POST", "/session_heartbeat", {"session_id": a["session"]}),
        ("POST", f"/sessions/{a['session']}/finish", {"reason": {"type": "success"}}),
        ("POST", "/create_model", {"session_id": a["session"], "model_seq_id": 50,
                                   "base_model": tiny_dir.name, "lora_config": {}}),
        ("POST", "/get_info", {"model_id": run}),
        ("POST", "/optim_step", {"model_id": run, "seq_id": 9, "adam_params": {}}),
        ("POST", "/save_weights", {"model_id": run, "path": "x", "seq_id": 9}),
        ("POST", "/save_weights_for_sampler", {"model_id": run, "path": "x", "seq_id": 9}),
        ("POST", "/load_weights", {"model_id": run, "seq_id": 9, "path": a["weights"]}),
        ("POST", "/load_weights", {"session_id": a["session"], "model_seq_id": 51,
                                   "path": a["weights"], "optimizer": True}),
        ("POST", "/weights_info", {"tinker_path": a["weights"]}),
        ("POST", "/create_sampling_session", {"session_id": a["session"],
                                              "sampling_session_seq_id": 7,
                                              "base_model": tiny_dir.name}),
        ("GET", f"/samplers/{a['sampler']}", None),
        ("POST", "/asample", {"sampling_session_id": a["sampler"], "num_samples": 1,
                              "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5]}]},
                              "sampling_params": {"max_tokens": 1}}),
        ("POST", "/retrieve_future", {"request_id": a["future"]}),
        ("GET", f"/training_runs/{run}", None),
        ("GET", f"/training_runs/{run}/checkpoints", None),
        ("DELETE", f"/training_runs/{run}/checkpoints/{ck}", None),
        ("POST", f"/training_runs/{run}/checkpoints/{ck}/publish", None),
        ("DELETE", f"/training_runs/{run}/checkpoints/{ck}/publish", None),
        ("PUT", f"/training_runs/{run}/checkpoints/{ck}/ttl", {"ttl_seconds": 5}),
        ("GET", f"/sessions/{a['session']}", None),
        ("GET", f"/sessions/{a['session']}/trace_export", None),
        ("GET", f"/training_runs/{run}/checkpoints/{ck}/external_weights_urls", None),
    ]
    with httpx.Client(base_url=f"{daemon.url}/api/v1", timeout=60,
                      headers={"X-API-Key": daemon.keys["bob"]}) as bob:
        tries = [(method, path, *_answer(bob.request(method, path, json=body)))
                 for method, path, body in calls]
        r = bob.post("/forward_backward", content=fwdbwd_body(run, 9, [5, 6, 7]),
                     headers={"Content-Type": "application/x-protobuf"})
        tries.append(("POST", "/forward_backward", *_answer(r)))
    return tries


def _answer(r: httpx.Response) -> tuple[int, str]:
    return r.status_code, r.text


def test_another_tenant_finds_nothing_of_alices(daemon, alices, bobs_tries):
    a, run = alices, alices["run"]
    for method, path, status, text in bobs_tries:
        assert status in (403, 404), (method, path, status, text)
    with httpx.Client(base_url=f"{daemon.url}/api/v1", timeout=60,
                      headers={"X-API-Key": daemon.keys["bob"]}) as bob:
        # Bob's listings do not show Alice's objects.
        assert run not in bob.get("/training_runs").text
        assert "alice-w" not in bob.get("/checkpoints").text
        assert a["session"] not in bob.get("/sessions").text


def test_alices_objects_are_intact_and_hers(daemon, alices, bobs_tries):
    with httpx.Client(base_url=f"{daemon.url}/api/v1", timeout=60,
                      headers={"X-API-Key": daemon.keys["alice"]}) as http:
        listed = http.get(f"/training_runs/{alices['run']}/checkpoints").json()["checkpoints"]
        assert {c["checkpoint_id"] for c in listed} == {"weights/alice-w", "sampler_weights/alice-s"}
        # Bob's delete, publish and ttl attempts changed nothing.
        assert all(not c["public"] and c.get("expires_at") is None for c in listed), listed
        assert http.get(f"/sessions/{alices['session']}").status_code == 200
        # The body bob sent is well-formed: for its owner it is accepted.
        r = http.post("/forward_backward", content=fwdbwd_body(alices["run"], 20, [5, 6, 7]),
                      headers={"Content-Type": "application/x-protobuf"})
        assert r.status_code == 200 and r.json()["request_id"]
        assert alices["session"] in http.get("/sessions").text


def test_a_published_checkpoint_is_loadable_by_another_tenant(daemon, alices, tiny_dir):
    """Published, alice's checkpoints can be trained from and sampled by bob; unpublished,
    they are not found again."""
    rest = tinker.RestClient(base_url=daemon.url, api_key=daemon.keys["alice"])
    bob = tinker.ServiceClient(base_url=daemon.url, api_key=daemon.keys["bob"])
    paths = (alices["weights"], alices["sampler_path"])
    prompt = tinker.types.ModelInput.from_ints([5, 6, 7, 8])
    for p in paths:
        rest.publish_checkpoint_from_tinker_path(p).result(timeout=60)
    try:
        tc = bob.create_training_client_from_state(alices["weights"]).result(timeout=60)
        d = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([5, 6, 7]),
                               loss_fn_inputs={"target_tokens": [6, 7, 8]})
        assert tc.forward([d], "cross_entropy").result(timeout=60).metrics["loss:sum"] > 0
        lps = bob.create_sampling_client(model_path=alices["sampler_path"]).compute_logprobs(
            prompt).result(timeout=60)
        assert len(lps) == 4
    finally:
        for p in paths:
            rest.unpublish_checkpoint_from_tinker_path(p).result(timeout=60)
    with pytest.raises((tinker.NotFoundError, tinker.RequestFailedError)):
        bob.create_training_client_from_state(alices["weights"]).result(timeout=60)
