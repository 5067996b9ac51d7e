"""Weights out: save_weights_external, signed download URLs and `tinker checkpoint download`,
with the unmodified tinker 0.38 client (and its CLI) against a real `twinkled serve`."""

from __future__ import annotations

import os
import stat
import time
import urllib.request
from pathlib import Path

import httpx
import pytest

tinker = pytest.importorskip("tinker")
os.environ.setdefault("TINKER_TELEMETRY", "0")

T = 120  # seconds: every .result() has a timeout, so a broken server fails, not hangs
TEXT = "the sun and the sea are big."
PEFT_FILES = {"adapter_config.json", "adapter_model.safetensors"}


def _rest(daemon, tenant: str):
    return tinker.RestClient(base_url=daemon.url, api_key=daemon.keys[tenant])


def _http(daemon, tenant: str | None) -> httpx.Client:
    headers = {"X-API-Key": daemon.keys[tenant]} if tenant else {}
    return httpx.Client(base_url=f"{daemon.url}/api/v1", headers=headers, timeout=60)


def _fetch(url: str, dest: Path) -> None:
    """As the tinker CLI does: plain urllib, no API key."""
    with urllib.request.urlopen(url, timeout=60) as r:
        dest.write_bytes(r.read())


def _data(tok):
    ids = tok(TEXT).input_ids
    return [tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": ids[1:]})]


@pytest.fixture(scope="module")
def export(daemon, tiny_dir):
    """Alice's run after two steps (so the adapter changes the logits), its training state
    and an external export at the same step."""
    sc = tinker.ServiceClient(base_url=daemon.url, api_key=daemon.keys["alice"])
    tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=4, seed=1).result(timeout=T)
    data = _data(tc.get_tokenizer())
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy").result(timeout=T)
        tc.optim_step(tinker.types.AdamParams(learning_rate=2e-2)).result(timeout=T)
    weights = tc.save_state("trained").result(timeout=T).path
    external = tc.save_weights_external("hf").result(timeout=T).path
    yield {"sc": sc, "tc": tc, "data": data, "weights": weights, "external": external}
    sc.close("success").result(timeout=T)


def test_exported_adapter_downloads_and_matches_the_daemon_in_peft(daemon, tiny_dir, export,
                                                                  tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tc, path = export["tc"], export["external"]
    assert path == f"tinker://{tc.model_id}/external_weights/hf"
    rest = _rest(daemon, "alice")
    listed = {c.checkpoint_id: c for c in rest.list_checkpoints(tc.model_id).result(timeout=T)
              .checkpoints}
    assert listed["external_weights/hf"].checkpoint_type == "external"
    assert listed["external_weights/hf"].size_bytes > 0
    answer = rest.get_external_weights_urls(path).result(timeout=T)
    assert set(answer.urls) == PEFT_FILES
    assert answer.expires.timestamp() > time.time() + 600
    for name, url in answer.urls.items():
        assert url.startswith(daemon.url + "/")  # the host the client came in on
        _fetch(url, tmp_path / name)
    ours = tc.forward(export["data"], "cross_entropy").result(timeout=T)
    want = ours.loss_fn_outputs[0]["logprobs"].tolist()
    d = export["data"][0]
    ids = torch.tensor([d.model_input.to_ints()])
    targets = torch.tensor(d.loss_fn_inputs["target_tokens"].tolist())
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    with torch.no_grad():
        plain = base(input_ids=ids).logits[0].log_softmax(-1)
        peft = PeftModel.from_pretrained(base, tmp_path)(input_ids=ids).logits[0].log_softmax(-1)
    rows = torch.arange(len(targets))
    got, before = peft[rows, targets].tolist(), plain[rows, targets].tolist()
    assert max(abs(a - b) for a, b in zip(got, before, strict=True)) > 1e-3  # trained
    assert got == pytest.approx(want, abs=1e-4)


def _cli(daemon, tenant: str, *args: str, cwd: Path):
    """`tinker ARGS` run in `cwd` as a user runs it (its key and base URL from the
    environment), by the CLI's own click group in this process: its code and exit status
    without a Python start and an SDK import for each call."""
    import contextlib

    from click.testing import CliRunner
    from tinker.cli.__main__ import main_cli

    env = {"TINKER_BASE_URL": daemon.url, "TINKER_API_KEY": daemon.keys[tenant],
           "TINKER_TELEMETRY": "0"}
    with contextlib.chdir(cwd):
        return CliRunner().invoke(main_cli, list(args), env=env)


def test_tinker_checkpoint_download_of_external_and_training_checkpoints(daemon, export,
                                                                        tmp_path):
    from safetensors.numpy import load_file

    got = {}
    for path in (export["external"], export["weights"]):
        out = _cli(daemon, "alice", "checkpoint", "download", path, "--output", "dl",
                   cwd=tmp_path)
        assert out.exit_code == 0, (out.output[-2000:], out.exception)
        target = tmp_path / "dl" / path.replace("tinker://", "").replace("/", "_")
        assert {p.name for p in target.iterdir()} == PEFT_FILES
        got[path] = load_file(target / "adapter_model.safetensors")
    a, b = got.values()  # one step: the export and the training state hold the same weights
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    # The CLI exported the training checkpoint through a temporary export it then deleted.
    for c in _rest(daemon, "alice").list_user_checkpoints(limit=1000).result(timeout=T).checkpoints:
        assert not c.checkpoint_id.startswith("external_weights/download"), c.tinker_path


def test_another_tenant_gets_a_404_that_says_nothing_of_what_exists(daemon, export):
    run = export["tc"].model_id
    with _http(daemon, "bob") as bob:
        mine = bob.get(f"/training_runs/{run}/checkpoints/external_weights/hf/"
                       "external_weights_urls")
        ghost = bob.get(f"/training_runs/{run}x/checkpoints/external_weights/hf/"
                        "external_weights_urls")
    assert mine.status_code == ghost.status_code == 404
    assert mine.json()["detail"].replace(run, "R") == ghost.json()["detail"].replace(run + "x", "R")
    with pytest.raises(tinker.NotFoundError):
        _rest(daemon, "bob").get_external_weights_urls(export["external"]).result(timeout=T)


def test_signed_urls_refuse_tampering_and_expiry(daemon, export):
    from tinker_shim.downloads import download_key, file_subject, sign
    from twinkled.store import Store

    urls = _rest(daemon, "alice").get_external_weights_urls(export["external"]).result(
        timeout=T).urls
    config, model = urls["adapter_config.json"], urls["adapter_model.safetensors"]
    with _http(daemon, None) as anyone:  # no API key: the signature is the credential
        assert anyone.get(config).status_code == 200
        flipped = config[:-1] + ("0" if config[-1] != "0" else "1")
        later = config.replace("expires=", "expires=1")
        swapped = model.split("?")[0] + "?" + config.split("?")[1]
        unsigned = config.split("?")[0]
        for bad in (flipped, later, swapped, unsigned):
            r = anyone.get(bad)
            assert r.status_code == 403 and "not valid" in r.json()["detail"], bad
        # A URL signed with this daemon's own key but an hour in the past: expired.
        key_file = daemon.data / "download.key"
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        store = Store(daemon.data / "twinkle.db")
        row = store.checkpoints.get(export["external"])
        store.close()
        past = int(time.time()) - 3600
        sig = sign(download_key(daemon.data), file_subject(row, "adapter_config.json"), past)
        r = anyone.get(f"{config.split('?')[0]}?expires={past}&sig={sig}")
        assert r.status_code == 403 and "expired" in r.json()["detail"]
        # `expires` is digits only: what int() also reads ("+", "_", spaces) is refused,
        # though the signature matches the number it stands for.
        base, query = config.split("?")
        expires, sig = (kv.split("=")[1] for kv in query.split("&"))
        for odd in (f"+{expires}", f"{expires[:3]}_{expires[3:]}", f"%20{expires}%20"):
            r = anyone.get(f"{base}?expires={odd}&sig={sig}")
            assert r.status_code == 403 and "not valid" in r.json()["detail"], odd


def test_an_export_saved_again_or_deleted_kills_its_old_links(daemon, export):
    tc, rest = export["tc"], _rest(daemon, "alice")
    path = tc.save_weights_external("again").result(timeout=T).path
    old = rest.get_external_weights_urls(path).result(timeout=T).urls["adapter_config.json"]
    tc.forward_backward(export["data"], "cross_entropy").result(timeout=T)
    tc.optim_step(tinker.types.AdamParams(learning_rate=2e-2)).result(timeout=T)
    # Saved again (new weights, so new content): the name is replaced.
    assert tc.save_weights_external("again").result(timeout=T).path == path
    new = rest.get_external_weights_urls(path).result(timeout=T).urls["adapter_config.json"]
    with _http(daemon, None) as anyone:
        assert anyone.get(old).status_code == 403
        assert anyone.get(new).status_code == 200
        rest.delete_checkpoint_from_tinker_path(path).result(timeout=T)
        assert anyone.get(new).status_code == 403
    ids = {c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result(timeout=T)
           .checkpoints}
    assert "external_weights/again" not in ids
    with pytest.raises(tinker.NotFoundError):
        rest.get_external_weights_urls(path).result(timeout=T)


def test_identical_weights_saved_again_kill_the_old_links(daemon, export):
    """Revocation by version, not content: the same weights saved again under the name
    (same sha256) still end the links given for the save before."""
    tc, rest = export["tc"], _rest(daemon, "alice")
    path = tc.save_weights_external("same").result(timeout=T).path
    old = rest.get_external_weights_urls(path).result(timeout=T).urls["adapter_config.json"]
    with _http(daemon, None) as anyone:
        assert anyone.get(old).status_code == 200
        assert tc.save_weights_external("same").result(timeout=T).path == path
        assert anyone.get(old).status_code == 403
        new = rest.get_external_weights_urls(path).result(timeout=T).urls
        assert anyone.get(new["adapter_config.json"]).status_code == 200


def test_external_checkpoints_take_ttl_publish_and_refusals_like_the_others(daemon, export):
    tc, rest, path = export["tc"], _rest(daemon, "alice"), export["external"]
    rest.set_checkpoint_ttl_from_tinker_path(path, 7200).result(timeout=T)
    rest.publish_checkpoint_from_tinker_path(path).result(timeout=T)
    c = {c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result(timeout=T)
         .checkpoints}[path]
    assert c.public and c.expires_at.timestamp() == pytest.approx(time.time() + 7200, abs=600)
    rest.unpublish_checkpoint_from_tinker_path(path).result(timeout=T)
    rest.set_checkpoint_ttl_from_tinker_path(path, None).result(timeout=T)
    # Download URLs are for external weights only; an export is not loaded back.
    with _http(daemon, "alice") as http:
        r = http.get(f"/training_runs/{tc.model_id}/checkpoints/weights/trained/"
                     "external_weights_urls")
    assert r.status_code == 400 and "external weights checkpoints only" in r.json()["detail"]
    with pytest.raises(tinker.BadRequestError, match="not a checkpoint path"):
        export["sc"].create_training_client_from_state(path).result(timeout=T)
    with pytest.raises(tinker.BadRequestError, match="age-encrypted"):
        tc.save_weights_external("enc", age_encryption_recipients=["age1xyz"]).result(timeout=T)


def test_exports_count_toward_the_storage_quota(daemon, tiny_dir):
    from daemon import make_key, run_ctl

    daemon.keys["carol"] = make_key(daemon.data, "carol")
    run_ctl(daemon.data, "tenants", "set", "carol", "--max-storage-bytes", "1000")
    sc = tinker.ServiceClient(base_url=daemon.url, api_key=daemon.keys["carol"])
    tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=2).result(timeout=T)
    tc.save_weights_external("first").result(timeout=T)  # under the quota when it started
    with pytest.raises(tinker.BadRequestError, match="storage quota"):
        tc.save_weights_external("second").result(timeout=T)
    sc.close("success").result(timeout=T)
