"""Dimuon through the unmodified tinker 0.38 client and a real `twinkled serve`: chosen at
create_model, stepped with DimuonParams, kept by checkpoints (and by every kind of restart:
test_tinker_restart.py, whose daemon lineage carries a Dimuon model through each)."""

from __future__ import annotations

import os

import httpx
import pytest

tinker = pytest.importorskip("tinker")
os.environ.setdefault("TINKER_TELEMETRY", "0")
types = tinker.types

T = 120
TEXTS = ["the sun and the sea are big.", "hello world from twinkle, yes."]
DIMUON = types.DimuonOptimizerConfig()


def _data(tok):
    out = []
    for text in TEXTS:
        ids = tok(text).input_ids
        out.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": ids[1:]}))
    return out


def _client(sc, tiny_dir, seed=0, optimizer=DIMUON):
    return sc.create_lora_training_client(base_model=tiny_dir.name, rank=4, seed=seed,
                                          optimizer=optimizer).result(timeout=T)


def _step(tc, data, lr=2e-2, beta1=0.9):
    loss = tc.forward_backward(data, "cross_entropy").result(timeout=T).metrics["loss:sum"]
    out = tc.optim_step(types.DimuonParams(learning_rate=lr, beta1=beta1)).result(timeout=T)
    return loss, out


def _logprobs(tc, data) -> list[float]:
    out = tc.forward(data, "cross_entropy").result(timeout=T)
    return [x for o in out.loss_fn_outputs for x in o["logprobs"].tolist()]


def test_a_dimuon_model_trains_and_says_so(daemon, tiny_dir):
    sc = tinker.ServiceClient(base_url=daemon.url, api_key=daemon.keys["alice"])
    tc = _client(sc, tiny_dir)
    assert tc.get_info().optimizer_config.type == "dimuon"
    data = _data(tc.get_tokenizer())
    losses = []
    for _ in range(8):
        loss, out = _step(tc, data)
        losses.append(loss)
        assert out.metrics["learning_rate:mean"] == pytest.approx(2e-2)
    assert losses[-1] < 0.5 * losses[0], losses
    # The step's params must be of the family chosen at creation.
    tc.forward_backward(data, "cross_entropy").result(timeout=T)
    with pytest.raises((tinker.RequestFailedError, tinker.BadRequestError),
                       match="adam_params: this model was created with the 'dimuon' optimizer"):
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=T)
    assert _step(tc, data)[1].metrics["step:max"] == 9  # the model goes on
    sc.close("success")


@pytest.mark.filterwarnings("ignore:DEPRECATED")  # load_state_with_optimizer: the legacy path
def test_checkpoints_keep_the_optimizer(daemon, tiny_dir):
    sc = tinker.ServiceClient(base_url=daemon.url, api_key=daemon.keys["bob"])
    tc = _client(sc, tiny_dir, seed=1)
    data = _data(tc.get_tokenizer())
    for _ in range(2):
        _step(tc, data, beta1=0.7)
    path = tc.save_state("d2").result(timeout=T).path
    _step(tc, data, beta1=0.7)
    want = _logprobs(tc, data)

    resumed = sc.create_training_client_from_state_with_optimizer(path).result(timeout=T)
    assert resumed.get_info().optimizer_config.type == "dimuon"
    _step(resumed, data, beta1=0.7)
    assert _logprobs(resumed, data) == pytest.approx(want, rel=1e-4, abs=1e-5)
    rest = tinker.RestClient(base_url=daemon.url, api_key=daemon.keys["bob"])
    info = rest.get_weights_info_by_tinker_path(path).result(timeout=T)
    assert info.optimizer_config.type == "dimuon"

    # Weights only: the new run's optimizer is the one asked for (AdamW by default).
    plain = sc.create_training_client_from_state(path).result(timeout=T)
    assert plain.get_info().optimizer_config.type == "adamw"
    plain.forward_backward(data, "cross_entropy").result(timeout=T)
    plain.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=T)
    again = sc.create_training_client_from_state(path, optimizer=DIMUON).result(timeout=T)
    assert again.get_info().optimizer_config.type == "dimuon"
    assert _step(again, data)[1].metrics["step:max"] == 1  # fresh optimizer state

    # AdamW state cannot be loaded into a Dimuon model: refused when asked, naming why.
    adam_tc = _client(sc, tiny_dir, seed=2, optimizer=None)
    adam_tc.forward_backward(data, "cross_entropy").result(timeout=T)
    adam_tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=T)
    adam_path = adam_tc.save_state("a1").result(timeout=T).path
    with pytest.raises((tinker.RequestFailedError, tinker.BadRequestError),
                       match="'adamw' optimizer state"):
        tc.load_state_with_optimizer(adam_path).result(timeout=T)
    sc.close("success")


@pytest.mark.parametrize(("params", "field"), [
    ({"type": "dimuon", "learning_rate": -1.0}, "optimizer_params.learning_rate"),
    ({"type": "dimuon", "learning_rate": 1e-2, "beta1": 1.0}, "optimizer_params.beta1"),
    ({"type": "dimuon", "learning_rate": 1e-2, "damping": 1e-4}, "optimizer_params.damping"),
    ({"type": "sgd", "learning_rate": 1e-2}, "optimizer_params.type"),
    ({"type": "dimuon"}, "learning_rate"),
])
def test_bad_dimuon_params_are_refused_at_the_door(daemon, tiny_dir, params, field):
    sc = tinker.ServiceClient(base_url=daemon.url, api_key=daemon.keys["alice"])
    tc = _client(sc, tiny_dir, seed=3)
    with httpx.Client(base_url=f"{daemon.url}/api/v1",
                      headers={"X-API-Key": daemon.keys["alice"]}) as http:
        r = http.post("/optim_step", json={"model_id": tc.model_id, "seq_id": 1,
                                           "optimizer_params": params, "type": "optim_step"})
        assert r.status_code == 400 and field in r.text, r.text
        bad = {"session_id": tc.model_id.split(":")[0], "model_seq_id": 99,
               "base_model": tiny_dir.name, "lora_config": {"rank": 4}}
        for cfg, name in (({"type": "dimuon", "version": 2}, "optimizer_config.version"),
                          ({"type": "lion"}, "optimizer_config.type")):
            r = http.post("/create_model", json={**bad, "optimizer_config": cfg})
            assert r.status_code == 400 and name in r.text, r.text
    sc.close("success")
