"""Checkpoint files through protocol/blobs.py: a directory and an S3-compatible object store
(moto's server, in this process, offline), then a daemon whose checkpoints live in that
store, driven by the unmodified tinker client."""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import time
from pathlib import Path

import pytest
from helpers import importorskip_deferred

from twinkled.protocol.blobs import Blobs, StoreError, is_remote, versioned
from twinkled.protocol.checkpoints import checkpoint_digest

importorskip_deferred("s3fs")
moto_server = importorskip_deferred("moto.server")

BUCKET = "ckpts"
# moto accepts any credentials; botocore tries a dead endpoint once (not 5 times, with
# back-off), so a stopped store fails a save at once.
AWS_ENV = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "1"}


@pytest.fixture(scope="module")
def s3():
    """An S3-compatible server on loopback with one bucket; its URL."""
    from daemon import free_port

    old = {k: os.environ.get(k) for k in AWS_ENV}
    os.environ.update(AWS_ENV)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(),
                                            verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    Blobs(f"s3://{BUCKET}", "/nonexistent", url).fs().mkdir(BUCKET)
    yield {"url": url, "server": server}
    server.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _write(files: dict[str, bytes]):
    def write(path: Path) -> None:  # as the engine does: a new directory with the files
        path.mkdir(parents=True)
        for name, data in files.items():
            (path / name).write_bytes(data)
    return write


FILES = {"adapter_model.safetensors": b"w" * 1000, "adapter_config.json": b"{}"}


@pytest.fixture(params=["dir", "s3"])
def blobs(request, tmp_path):
    if request.param == "dir":
        return Blobs(tmp_path / "shared", tmp_path / "cache")
    return Blobs(f"s3://{BUCKET}/{tmp_path.name}", tmp_path / "cache",
                 request.getfixturevalue("s3")["url"])


def test_a_saved_checkpoint_lists_fetches_elsewhere_and_deletes(blobs, tmp_path):
    base = blobs.base("run1", "weights", "s1")
    size, sha = blobs.save(base, _write(FILES))
    assert size == sum(map(len, FILES.values()))
    where = versioned(base, sha)
    assert blobs.files(where) == {k: len(v) for k, v in FILES.items()}
    assert blobs.digest(where) == (size, sha)
    # Another host: its own cache, the same store.
    other = Blobs(blobs.root, tmp_path / "other-cache", blobs.endpoint)
    local = other.local(where)
    assert checkpoint_digest(local) == (size, sha)
    assert {p.name: p.read_bytes() for p in local.iterdir()} == FILES
    if is_remote(where):
        assert local == tmp_path / "other-cache" / sha  # cached by its digest
        assert other.local(where) == local
    blobs.delete(where)
    with pytest.raises(FileNotFoundError):
        blobs.files(where)
    blobs.delete(where)  # nothing left: nothing to do


def test_a_new_version_goes_under_its_own_digest_and_the_old_stays_readable(s3, tmp_path):
    blobs = Blobs(f"s3://{BUCKET}/versions", tmp_path / "cache", s3["url"])
    base = blobs.base("run1", "weights", "same-name")
    _, old = blobs.save(base, _write(FILES))
    _, new = blobs.save(base, _write({**FILES, "adapter_config.json": b"{ }"}))
    assert old != new
    reader = Blobs(blobs.root, tmp_path / "reader", s3["url"])
    assert checkpoint_digest(reader.local(versioned(base, old)))[1] == old


def test_objects_changed_in_the_store_are_refused_on_fetch(s3, tmp_path):
    blobs = Blobs(f"s3://{BUCKET}/tamper", tmp_path / "cache", s3["url"])
    base = blobs.base("run1", "weights", "t")
    _, sha = blobs.save(base, _write(FILES))
    where = versioned(base, sha)
    blobs.fs().pipe(f"{where[5:]}/adapter_config.json", b"{\"r\": 99}")
    with pytest.raises(StoreError, match="other files than were saved"):
        Blobs(blobs.root, tmp_path / "reader", s3["url"]).local(where)
    assert not (tmp_path / "reader" / sha).exists()


def test_an_unreachable_store_fails_the_save_by_name_and_leaves_nothing(tmp_path,
                                                                          monkeypatch):
    from daemon import free_port

    for k, v in AWS_ENV.items():  # (the module's server fixture may not have run)
        monkeypatch.setenv(k, v)
    blobs = Blobs(f"s3://{BUCKET}/down", tmp_path / "cache", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(StoreError, match=r"checkpoint store: .* s3://ckpts/down/r/weights/x"):
        blobs.save(blobs.base("r", "weights", "x"), _write(FILES))
    assert not any(p.name != ".staging" for p in (tmp_path / "cache").iterdir())
    assert not any((tmp_path / "cache" / ".staging").iterdir())


@pytest.mark.parametrize("value,ok", [("", True), ("/mnt/shared/ckpts", True),
                                      ("s3://my-bucket/twinkle/prod", True),
                                      ("relative/dir", False), ("s3://", False),
                                      ("gs://bucket", False), ("s3://Bad_Bucket", False)])
def test_the_store_key_takes_a_directory_or_an_s3_url(tmp_path, value, ok):
    from twinkled.protocol.config import check_config

    cfg = tmp_path / "t.toml"
    cfg.write_text(f'checkpoint_store = "{value}"\ncheckpoint_store_endpoint = "http://m:9000"\n')
    problems = check_config(cfg)
    assert (problems == []) if ok else problems[0].startswith("checkpoint_store: must be")

# -- a daemon whose checkpoints live in the store --------------------------------------

tinker = pytest.importorskip("tinker")
os.environ.setdefault("TINKER_TELEMETRY", "0")
T = 120  # seconds: every .result() has a timeout, so a broken server fails, not hangs
PREFIX = "daemon"


@pytest.fixture(scope="module")
def stored(s3, tiny_dir, tmp_path_factory):
    """A daemon with checkpoint_store = s3://ckpts/daemon; alice's run after one step."""
    from daemon import Daemon, make_key

    data = tmp_path_factory.mktemp("data")
    cfg = data / "twinkled.toml"
    cfg.write_text(f'checkpoint_store = "s3://{BUCKET}/{PREFIX}"\n'
                   f'checkpoint_store_endpoint = "{s3["url"]}"\ndrain_timeout_s = 1\n')
    d = Daemon(tiny_dir, data, data / "twinkled.log", "--config", str(cfg), env=AWS_ENV)
    try:
        key = make_key(data, "alice")
        sc = tinker.ServiceClient(base_url=d.url, api_key=key)
        tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=4,
                                            seed=1).result(timeout=T)
        ids = tc.get_tokenizer()("the sun and the sea are big.").input_ids
        batch = [tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
                                    loss_fn_inputs={"target_tokens": ids[1:]})]
        tc.forward_backward(batch, "cross_entropy").result(timeout=T)
        tc.optim_step(tinker.types.AdamParams(learning_rate=2e-2)).result(timeout=T)
        yield {"daemon": d, "key": key, "sc": sc, "tc": tc, "batch": batch,
               "fs": Blobs(f"s3://{BUCKET}", data, s3["url"]).fs()}
    finally:
        d.stop()


def _logprobs(tc, batch) -> list[float]:
    return tc.forward(batch, "cross_entropy").result(timeout=T).loss_fn_outputs[0][
        "logprobs"].tolist()


def test_save_state_lands_in_the_store_and_a_new_client_loads_downloads_and_deletes_it(
        stored):
    import httpx

    d, sc, tc, fs = stored["daemon"], stored["sc"], stored["tc"], stored["fs"]
    path = tc.save_state("s1").result(timeout=T).path
    prefix = f"{BUCKET}/{PREFIX}/{tc.model_id}/weights/s1"
    objects = fs.find(prefix)
    sha = objects[0].split("/")[-2]
    assert {o.rpartition("/")[2] for o in objects} >= {"adapter_model.safetensors",
                                                        "adapter_config.json"}
    assert all(o.startswith(f"{prefix}/{sha}/") for o in objects)
    assert not (d.data_dir / "checkpoints").exists()  # nothing on the head's disk
    # A load on a host without the files (the saving worker's copy removed) fetches them.
    cached = d.data_dir / "checkpoint-cache" / sha
    shutil.rmtree(cached)
    loaded = sc.create_training_client_from_state(path).result(timeout=T)
    assert cached.is_dir()
    assert _logprobs(loaded, stored["batch"]) == pytest.approx(
        _logprobs(tc, stored["batch"]), abs=1e-5)
    # The REST archive (SDK <= 0.35's download) is built from the store's files.
    with httpx.Client(base_url=f"{d.url}/api/v1", headers={"X-API-Key": stored["key"]},
                      timeout=60, follow_redirects=True) as http:
        got = http.get(f"/training_runs/{tc.model_id}/checkpoints/weights/s1/archive")
    assert got.status_code == 200, got.text
    names = tarfile.open(fileobj=io.BytesIO(got.content)).getnames()
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(names)
    # Sampler weights in the store: a sampling client on their path samples from them.
    sampler = tc.save_weights_for_sampler("sw").result(timeout=T).path
    assert fs.find(f"{BUCKET}/{PREFIX}/{tc.model_id}/sampler_weights/sw")
    prompt = tinker.types.ModelInput.from_ints(stored["batch"][0].model_input.to_ints()[:4])
    out = sc.create_sampling_client(model_path=sampler).sample(
        prompt, 1, tinker.types.SamplingParams(max_tokens=3, temperature=0.0)).result(timeout=T)
    assert len(out.sequences[0].tokens) == 3
    # A new version of it (overwrite) goes under its own digest; the old one's objects go.
    tc.forward_backward(stored["batch"], "cross_entropy").result(timeout=T)
    tc.optim_step(tinker.types.AdamParams(learning_rate=2e-2)).result(timeout=T)
    assert tc.save_state("s1", overwrite=True).result(timeout=T).path == path
    deadline = time.monotonic() + 30  # (removed behind the answer, in a thread)
    while len(versions := {o.split("/")[-2] for o in fs.find(prefix)}) != 1:
        assert time.monotonic() < deadline, versions
        time.sleep(0.1)
    assert versions != {sha}
    rest = tinker.RestClient(base_url=d.url, api_key=stored["key"])
    rest.delete_checkpoint_from_tinker_path(path).result(timeout=T)
    assert fs.find(prefix) == []


def test_a_save_whose_upload_fails_says_so_and_is_never_listed(stored, s3):
    from twinkled.store import Store

    d, tc = stored["daemon"], stored["tc"]
    s3["server"].stop()  # the store goes away (the module's last test)
    with pytest.raises(Exception, match="checkpoint store: .* failed"):
        tc.save_state("lost").result(timeout=T)
    rest = tinker.RestClient(base_url=d.url, api_key=stored["key"])
    listed = rest.list_checkpoints(tc.model_id).result(timeout=T).checkpoints
    assert "weights/lost" not in {c.checkpoint_id for c in listed}
    store = Store(d.data_dir / "twinkle.db")
    try:
        row = store.checkpoints.get(f"tinker://{tc.model_id}/weights/lost")
    finally:
        store.close()
    assert row["status"] == "corrupt"  # kept for admins (the reason), served to no one
