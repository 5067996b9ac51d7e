"""Records: checkpoint user_metadata, base_model checks, samplers' tokenizers, session search,
session traces, storage usage, and the SDK calls refused by name; with the unmodified tinker
0.38 client against a real `twinkled serve`."""

from __future__ import annotations

import json
import os
import urllib.request
import uuid
import warnings
from pathlib import Path

import httpx
import pytest

tinker = pytest.importorskip("tinker")
os.environ.setdefault("TINKER_TELEMETRY", "0")
T = 120  # seconds: every .result() has a timeout, so a broken server fails, not hangs
types = tinker.types


def _service(daemon, tenant="alice", **kw):
    return tinker.ServiceClient(base_url=daemon.url, api_key=daemon.keys[tenant], **kw)


def _rest(daemon, tenant="alice"):
    return tinker.RestClient(base_url=daemon.url, api_key=daemon.keys[tenant])


def _search(daemon, tenant="alice", **kw) -> types.SessionSearchResponse:
    with warnings.catch_warnings():  # search_sessions is experimental in 0.38
        warnings.simplefilter("ignore")
        return _rest(daemon, tenant).search_sessions(
            types.SessionSearchRequest(**kw)).result(timeout=T)


def _datum(ids):
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:]})


def test_checkpoints_keep_and_list_user_metadata(daemon, tiny_dir):
    sc = _service(daemon)
    tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=2).result(timeout=T)
    w = tc.save_state("meta-w", user_metadata={"step": "0", "note": "first"}).result(timeout=T)
    s = tc.save_weights_for_sampler("meta-s", user_metadata={"k": "v"}).result(timeout=T)
    tc.save_state("meta-none").result(timeout=T)
    listed = {c.tinker_path: c.user_metadata
              for c in _rest(daemon).list_checkpoints(tc.model_id).result(timeout=T).checkpoints}
    assert listed[w.path] == {"step": "0", "note": "first"}
    assert listed[s.path] == {"k": "v"}
    assert listed[w.path.replace("meta-w", "meta-none")] is None
    sc.close("success").result(timeout=T)


def test_a_base_model_other_than_the_served_one_is_refused(daemon, tiny_dir):
    sc = _service(daemon)
    tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=2).result(timeout=T)
    path = tc.save_state("bm").result(timeout=T).path
    for call in (lambda: sc.create_training_client_from_state(path, base_model="org/other"),
                 lambda: sc.create_training_client_from_state_with_optimizer(
                     path, base_model="org/other"),
                 lambda: sc.create_lora_training_client(base_model="org/other"),
                 lambda: sc.create_sampling_client(base_model="org/other")):
        with pytest.raises(tinker.BadRequestError, match="'org/other' is not served here"):
            call().result(timeout=T)
    # The served name, and the name a sampler reports (its tokenizer's), are the model.
    loaded = sc.create_training_client_from_state(path, base_model=tiny_dir.name).result(timeout=T)
    sampler = sc.create_sampling_client(model_path=tc.save_weights_for_sampler("bm-s")
                                        .result(timeout=T).path).result(timeout=T)
    same = sc.create_sampling_client(base_model=sampler.get_base_model()).result(timeout=T)
    assert loaded.get_info().model_data.model_name == same.get_base_model()
    sc.close("success").result(timeout=T)


def test_tenants_see_the_served_name_never_the_servers_path(daemon, tiny_dir, monkeypatch):
    # Issue 30 item 9: get_info, get_base_model and GET /samplers gave the daemon's model
    # directory (with a trailing '/') where the run was made under its served name.
    sc = _service(daemon)
    tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=2).result(timeout=T)
    info = tc.get_info()
    assert info.model_data.model_name == tiny_dir.name
    # The training client's tokenizer still loads: tokenizer_id is what resolves.
    assert os.path.samefile(info.model_data.tokenizer_id, tiny_dir)
    want = tc.get_tokenizer()("the sun and the sea are big.").input_ids
    path = tc.save_weights_for_sampler("tok").result(timeout=T).path
    samplers = [sc.create_sampling_client(model_path=path).result(timeout=T),
                tc.save_weights_and_get_sampling_client().result(timeout=T),
                sc.create_sampling_client(base_model=tiny_dir.name).result(timeout=T)]
    assert [s.get_base_model() for s in samplers] == [tiny_dir.name] * 3
    for s in samplers:  # GET /samplers itself (the SDK gives its sampler id no public name)
        got = httpx.get(f"{daemon.url}/api/v1/samplers/{s._sampling_session_id}",
                        headers={"X-API-Key": daemon.keys["alice"]}, timeout=30).json()
        assert got["base_model"] == tiny_dir.name, got
    # A sampler resolves its tokenizer from that name (hence --model-name <hub id>); here
    # the name resolves as a directory relative to the client's working directory.
    monkeypatch.chdir(tiny_dir.parent)
    assert samplers[0].get_tokenizer()("the sun and the sea are big.").input_ids == want
    sc.close("success").result(timeout=T)


def test_a_server_side_custom_loss_says_custom_losses_run_on_the_client(daemon, tiny_dir):
    sc = _service(daemon)
    tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=2).result(timeout=T)
    with pytest.raises(tinker.BadRequestError, match="forward_backward_custom") as err:
        tc.forward_backward([_datum([5, 6, 7, 8])], "custom",
                            {"loss_id": "my-loss"}).result(timeout=T)
    assert "only numeric values" not in str(err.value)
    sc.close("success").result(timeout=T)


def test_a_sampler_rebuilt_from_its_handle_samples(daemon, tiny_dir, monkeypatch):
    # A clone counts its seq_ids from 1e9 * a random clone id: far past 2**53.
    monkeypatch.setenv("TINKER_BASE_URL", daemon.url)
    monkeypatch.setenv("TINKER_API_KEY", daemon.keys["alice"])
    sc = _service(daemon)
    tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=2).result(timeout=T)
    handle = tc.save_weights_and_get_sampling_client().result(timeout=T).get_sampler_handle()
    clone = tinker.SamplingClient.from_sampler_handle(handle)
    out = clone.sample(types.ModelInput.from_ints([5, 6]), 1,
                       types.SamplingParams(max_tokens=2)).result(timeout=T)
    assert len(out.sequences[0].tokens) == 2
    sc.close("success").result(timeout=T)


def test_tokenizer_name_is_the_hub_id_when_served_under_one(tiny_dir, tmp_path):
    from tinker_shim.common import tokenizer_name
    from twinkled.protocol.config import Config

    assert tokenizer_name(Config(model=tiny_dir, model_name="Qwen/Qwen3-8B")) == "Qwen/Qwen3-8B"
    assert tokenizer_name(Config(model=tiny_dir)) == str(tiny_dir.resolve())
    assert tokenizer_name(Config(model=tiny_dir, model_name="mine")) == str(tiny_dir.resolve())
    # A two-level directory is given as it is (tokenizer_id skips the SDK's name heuristics).
    assert tokenizer_name(Config(model=Path("/srv/model"))) == "/srv/model"


def test_search_finds_only_the_callers_sessions_that_match(daemon, tiny_dir):
    tag = uuid.uuid4().hex
    first = _service(daemon, display_name="Nightly alpha", user_metadata={"suite": tag})
    second = _service(daemon, display_name="weekly beta", user_metadata={"suite": tag, "n": "2"})
    ids = []
    for sc in (first, second):  # a session is made by its first use
        tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=2).result(timeout=T)
        tc.save_state("s").result(timeout=T)
        ids.append(tc.model_id.split(":train:")[0])
    found = _search(daemon, user_metadata={"suite": tag}).sessions
    assert [s.session_id for s in found] == ids[::-1]  # newest first
    assert all(s.owner == "alice" and s.checkpoints_count == 1 and s.checkpoint_storage_bytes
               for s in found)
    assert found[0].display_name == "weekly beta" and found[0].user_metadata["n"] == "2"
    assert [s.session_id for s in _search(daemon, user_metadata={"suite": tag},
                                          display_name="NIGHTLY alp").sessions] == [ids[0]]
    either = _search(daemon, user_metadata={"suite": tag}, display_name="nightly",
                     session_id=ids[1])
    assert {s.session_id for s in either.sessions} == set(ids)
    # One page at a time: every session once, then no cursor.
    pages, cursor = [], None
    while True:
        page = _search(daemon, user_metadata={"suite": tag}, limit=1, cursor=cursor)
        pages += [s.session_id for s in page.sessions]
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert pages == ids[::-1]
    # Statuses: both heartbeat; once the first is closed it is client_finished (success).
    active = _search(daemon, user_metadata={"suite": tag}, statuses=[{"type": "active"}])
    assert len(active.sessions) == 2
    first.close("success").result(timeout=T)
    done = _search(daemon, user_metadata={"suite": tag},
                   statuses=[{"type": "client_finished", "reasons": ["success"]}]).sessions
    assert [s.session_id for s in done] == [ids[0]]
    assert done[0].status.type == "client_finished" and done[0].status.reason.type == "success"
    assert not _search(daemon, user_metadata={"suite": tag},
                       statuses=[{"type": "client_finished", "reasons": ["errored"]}]).sessions
    # Another tenant finds none of them, whatever owner it asks for.
    for owner in ({"type": "own"}, {"type": "accessible"},
                  {"type": "user", "owner_urns": ["alice"]}):
        assert not _search(daemon, "bob", user_metadata={"suite": tag}, owner=owner).sessions
    with pytest.raises(tinker.BadRequestError, match="projects are not supported"):
        _search(daemon, project_ids=["p1"])
    second.close("success").result(timeout=T)


def test_a_session_trace_shows_its_runs_requests_and_checkpoints(daemon, tiny_dir):
    sc = _service(daemon)
    tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=2).result(timeout=T)
    tc.forward_backward([_datum([5, 6, 7, 8])], "cross_entropy").result(timeout=T)
    tc.optim_step(types.AdamParams()).result(timeout=T)
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=T)
    sampler.sample(types.ModelInput.from_ints([5, 6]), 1,
                   types.SamplingParams(max_tokens=2)).result(timeout=T)
    session = tc.model_id.split(":train:")[0]
    url = _rest(daemon).export_session_trace(session).result(timeout=T)
    with urllib.request.urlopen(url, timeout=60) as r:  # no API key: a signed URL
        trace = json.loads(r.read())
    events = trace["traceEvents"]
    tracks = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
    run, samp = tracks[f"run {tc.model_id}"], tracks[f"sampler {session}:sample:0"]
    on = {(e["tid"], e["name"]) for e in events if e["ph"] == "X"}
    for name in ("create_model", "forward_backward", "optim_step", "save"):
        assert (run, name) in on, name
    assert (samp, "sample") in on
    assert any(e["ph"] == "i" and e["tid"] == run and "sampler_weights/" in e["name"]
               for e in events)
    assert trace["otherData"] == {"session_id": session, "owner": "alice"}
    with pytest.raises(tinker.NotFoundError):
        _rest(daemon, "bob").export_session_trace(session).result(timeout=T)
    with httpx.Client(timeout=60) as anyone:
        assert anyone.get(url.replace("sig=", "sig=0")).status_code == 403
        other = url.replace(session, session[:-1] + ("0" if session[-1] != "0" else "1"))
        assert anyone.get(other).status_code == 403
    sc.close("success").result(timeout=T)


def test_checkpoint_storage_usage_is_the_callers_own(daemon, tiny_dir):
    mine = _rest(daemon).list_user_checkpoints(limit=10_000).result(timeout=T).checkpoints
    usage = tinker.AdminClient(base_url=daemon.url, api_key=daemon.keys["alice"]) \
        .get_current_checkpoint_storage_usage().result(timeout=T)
    (row,) = usage.data
    assert row.checkpoint_count == len(mine) > 0
    assert row.size_bytes == sum(c.size_bytes for c in mine)
    assert row.user_name == "alice" and row.size_gigabytes == row.size_bytes / 1e9
    bob = tinker.AdminClient(base_url=daemon.url, api_key=daemon.keys["bob"]) \
        .get_current_checkpoint_storage_usage().result(timeout=T).data[0]
    assert bob.user_name == "bob"
    with pytest.raises(tinker.BadRequestError, match="projects are not supported"):
        tinker.AdminClient(base_url=daemon.url, api_key=daemon.keys["alice"]) \
            .get_current_checkpoint_storage_usage("p1").result(timeout=T)


def test_calls_this_server_does_not_serve_are_refused_by_name(daemon):
    from datetime import UTC, datetime, timedelta

    rest = _rest(daemon)
    admin = tinker.AdminClient(base_url=daemon.url, api_key=daemon.keys["alice"])
    now = datetime.now(UTC)
    refused = [(lambda: admin.get_audit_log(), "audit log"),
               (lambda: admin.get_billing_usage(now - timedelta(days=1), now), "billing usage"),
               (lambda: rest.assign_session_project("sess-x", "p1"), "projects"),
               (lambda: rest.copy_weights("tinker://r:train:0/weights/x", "p1"),
                "copying weights")]
    for call, name in refused:
        with pytest.raises(tinker.BadRequestError, match=name):
            call().result(timeout=T)
    with pytest.raises(RuntimeError, match="JWT"):  # the SDK answers whoami itself
        rest.whoami().result(timeout=T)
