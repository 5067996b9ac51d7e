"""The documented limits (docs/reference.md, "Limits"): each is refused at the door with a
400 that names the field and the limit, on the session daemon (default limits)."""

from __future__ import annotations

import pytest
from hostile import Raw, fwdbwd_proto, pb

pytest.importorskip("tinker")


@pytest.fixture(scope="module")
def raw(daemon, tiny_dir):
    r = Raw(daemon.url, daemon.keys["bob"])
    r.base_model = tiny_dir.name
    r.session()
    yield r
    r.close()


def _refused(answer, *names: str) -> None:
    assert answer.status == 400, answer.describe()
    detail = answer.json["detail"]
    assert all(n in detail for n in names), detail


def test_more_than_max_datums_is_refused(raw):
    model = raw.model()
    req = pb().ForwardBackwardRequest.FromString(fwdbwd_proto(model, 1))
    for _ in range(4096):  # 4097 in all: one past max_datums
        req.data.add().CopyFrom(req.data[0])
    a = raw.post("/forward_backward", content=req.SerializeToString(),
                 headers={"Content-Type": "application/x-protobuf"})
    _refused(a, "4097", "4096", "max_datums")


def test_more_than_max_stop_strings_is_refused(raw):
    sampler = raw.sampler()
    a = raw.post("/asample", raw.sample_body(sampler, stop=[f"s{i}" for i in range(33)]))
    _refused(a, "stop", "33 stop strings", "32", "max_stop")


def test_more_than_max_stop_ids_is_refused(raw):
    """Token ids have their own, larger limit (a set lookup per token): 1,025 is refused."""
    sampler = raw.sampler()
    a = raw.post("/asample", raw.sample_body(sampler, stop=list(range(1024)) + [0]))
    _refused(a, "stop", "1025 stop token ids", "1024", "max_stop_ids")


def test_a_thousand_stop_token_ids_sample_through_the_tinker_client(daemon, tiny_dir):
    """An RL environment stops on a class of tokens: 1,000 ids (max_stop was 32 for all)
    sample, and every sequence ends at its first token of the class."""
    import tinker

    sc = tinker.ServiceClient(base_url=daemon.url, api_key=daemon.keys["bob"])
    sampler = sc.create_sampling_client(base_model=tiny_dir.name).result(timeout=60)
    stop = list(range(1, 1001))  # nearly the whole tiny vocabulary: the rows stop early
    out = sampler.sample(prompt=tinker.types.ModelInput.from_ints([5, 6, 7]), num_samples=4,
                         sampling_params=tinker.types.SamplingParams(
                             max_tokens=32, temperature=1.0, seed=11, stop=stop)
                         ).result(timeout=120)
    stops = set(stop)
    assert len(out.sequences) == 4
    for seq in out.sequences:
        assert seq.stop_reason == "stop", seq.tokens
        assert seq.tokens[-1] in stops and not stops & set(seq.tokens[:-1]), seq.tokens


def test_a_ttl_over_max_ttl_s_is_refused(raw):
    model = raw.model()
    a = raw.post("/save_weights", {"model_id": model, "seq_id": 1, "path": "ttl",
                                   "ttl_seconds": 315360001, "type": "save_weights"})
    _refused(a, "ttl_seconds", "315360000", "max_ttl_s")


def test_user_metadata_over_max_metadata_bytes_is_refused(raw):
    a = raw.post("/create_session", {"tags": [], "user_metadata": {"x": "a" * 65536},
                                     "sdk_version": "0.38.0", "type": "create_session"})
    _refused(a, "user_metadata", "65536", "max_metadata_bytes")
