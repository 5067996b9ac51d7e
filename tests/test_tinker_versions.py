"""Every tinker SDK from 0.16.1 to 0.38.0, unmodified, against one real `twinkled serve`.

Each version (tests/tinker_sdks.py: which, and where `make install` puts them) runs one
round trip in its own process, with only its `tinker` package ahead of the project's
environment: train a step (forward_backward with cross_entropy, optim_step, forward), save
weights for a sampler and sample from them, save the state and load it into a new model.
Up to 0.24 that is the JSON wire (tinker_shim/json_wire.py); from 0.25 the protobuf one.
A version that is not installed (offline) is skipped, saying how to install it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import tinker_sdks

HERE = Path(__file__).parent


def _version(version: str):
    """A case per version, skipped (before the daemon starts) where it is not installed."""
    missing = pytest.mark.skipif(
        not tinker_sdks.installed(version),
        reason=f"tinker=={version} is not installed in {tinker_sdks.target(version)}: "
               "`make install` (or `python tests/tinker_sdks.py install`) puts it there")
    return pytest.param(version, marks=missing, id=version)


@pytest.mark.parametrize("version", [_version(v) for v in tinker_sdks.VERSIONS])
def test_an_unmodified_sdk_trains_samples_saves_and_loads(version, daemon, tiny_dir):
    env = dict(os.environ, PYTHONPATH=str(tinker_sdks.target(version)))
    proc = subprocess.run([sys.executable, str(HERE / "tinker_sdks.py"), "run", daemon.url,
                           daemon.keys["alice"], tiny_dir.name],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["version"] == version  # that SDK ran, not the project's own
    assert got["logprobs"] == 8  # one per target token, read back from the result
    assert got["loss_after"] < got["loss_before"]  # the step trained the adapter
    # The state saved and loaded into a new model is the trained one, not a fresh adapter.
    assert got["loss_loaded"] == pytest.approx(got["loss_after"], rel=1e-5)
    assert len(got["sampled"]) == 4 and len(got["sampled_logprobs"]) == 4
    assert all(lp <= 0 for lp in got["sampled_logprobs"])
    assert got["sampler_path"].endswith("/sampler_weights/rt-sampler")
    assert got["state_path"].endswith("/weights/rt-state")
    if _older(version, "0.36.0"):  # RestClient.get_checkpoint_archive_url*: a tar, signed
        assert sorted(got["archive"]) == ["adapter_config.json", "adapter_model.safetensors",
                                          "checkpoint_complete"]
        forged = got["archive_url"].replace("sig=", "sig=0")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(forged, timeout=30)
        assert e.value.code == 403
    else:
        assert got["archive"] is None  # the method is gone from the SDK


def _older(version: str, than: str) -> bool:
    return tuple(map(int, version.split("."))) < tuple(map(int, than.split(".")))


def test_the_json_wire_refuses_bad_bodies_with_a_400_and_answers_in_json(daemon, tiny_dir):
    """Through the daemon: a bad JSON body is a 400 naming what is wrong, and takes its
    seq_id (the next ones run, not wait for it); a poll that does not accept protobuf gets
    the result as JSON, one that does gets protobuf."""
    from hostile import Raw

    raw = Raw(daemon.url, daemon.keys["bob"])
    raw.c.headers["Accept"] = "application/json"  # as SDK 0.16/0.17 ask
    raw.base_model = tiny_dir.name
    raw.session()
    model = raw.model()
    tokens, targets = [5, 17, 42], [17, 42, 99]

    def body(seq_id: int, targets=targets, key="forward_backward_input") -> dict:
        datum = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
                 "loss_fn_inputs": {"target_tokens": {"data": targets, "dtype": "int64"}}}
        return {key: {"data": [datum], "loss_fn": "cross_entropy"}, "model_id": model,
                "seq_id": seq_id}

    bad = raw.post("/forward_backward", body(1, targets=[17.5, 42, 99]))
    assert bad.status == 400 and "non-integer" in bad.json["detail"], bad.describe()
    bad = raw.post("/forward_backward", body(2, targets=[17, 42]))
    assert bad.status == 400 and "target_tokens" in bad.json["detail"], bad.describe()
    fb = raw.result(raw.post("/forward_backward", body(3)), "JSON forward_backward")
    assert fb.content_type.startswith("application/json")  # asked for JSON alone
    out = fb.json["loss_fn_outputs"][0]["logprobs"]
    assert out["dtype"] == "float32" and out["shape"] == [3] and len(out["data"]) == 3
    raw.result(raw.optim(model, 4), "optim_step after the refusals")
    fwd = raw.post("/forward", body(5, key="forward_input"))
    assert fwd.status == 200, fwd.describe()
    for _ in range(60):  # each poll is held up to poll_seconds; try_again is JSON
        proto = raw.c.post("/retrieve_future", json={"request_id": fwd.json["request_id"]},
                           headers={"Accept": "application/x-protobuf"}, timeout=60)
        if not proto.headers["content-type"].startswith("application/json"):
            break
        assert proto.json()["type"] == "try_again", proto.text
    assert proto.headers["content-type"].startswith("application/x-protobuf")
    raw.close()
