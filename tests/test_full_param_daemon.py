"""Full-parameter runs (rank 0) through the unmodified tinker client against a real
`twinkled serve` of two lanes: the run holds one lane alone and trains as plain torch AdamW
does, a LoRA tenant trains on the other lane meanwhile, save_state/load_state round trip,
sampling from the run's weights, the external export loads in transformers; and the
refusals (policy, no free lane, one lane) are clear 400s. A one-lane daemon whose operator
lets a full run take its lane (full_run_only_lane) lends it to one, over both its workers
(2 ranks, gloo), and shares it again once the run ends."""

from __future__ import annotations

import os
import signal
import time
import urllib.request

import pytest
import torch
from daemon import Daemon, ctl_status, make_key, run_ctl
from test_workers import _data

from twinkled.server.ctl import Target

tinker = pytest.importorskip("tinker")
os.environ.setdefault("TINKER_TELEMETRY", "0")

T = 120
TEXTS = ["the sun and the sea are big.", "a cat sat on the mat today"]
ADAM = dict(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01)


@pytest.fixture(scope="module")
def two_lanes(tiny_dir, tmp_path_factory):
    """Two lanes of one CPU worker each; full runs only for tenants marked (alice, in the
    config file)."""
    data = tmp_path_factory.mktemp("full")
    cfg = data / "twinkled.toml"
    cfg.write_text('full_runs = "marked"\n\n[tenants.alice]\nmax_full_runs = 2\n')
    keys = {t: make_key(data, t) for t in ("alice", "bob")}
    d = Daemon(tiny_dir, data, data / "log", "--workers", "2", "--lanes", "2",
               "--config", str(cfg))
    d.keys = keys
    yield d
    d.stop()


def _client(d, tenant):
    return tinker.ServiceClient(base_url=d.url, api_key=d.keys[tenant])


def _step(tc, data) -> float:
    out = tc.forward_backward(data, "cross_entropy").result(timeout=T)
    tc.optim_step(tinker.types.AdamParams(**ADAM)).result(timeout=T)
    return out.metrics["loss:sum"]


def _wait_lane_empty(d, lane: int) -> None:
    deadline = time.monotonic() + 30
    while ctl_status(d.data_dir)["lanes"][lane]["adapters"] and time.monotonic() < deadline:
        time.sleep(0.2)


def _logprobs(tc, data) -> list[float]:
    out = tc.forward(data, "cross_entropy").result(timeout=T)
    return [x for o in out.loss_fn_outputs for x in o["logprobs"].tolist()]


def _plain(model_dir, data, steps):
    """The reference: the same model and steps with plain torch AdamW."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(hf.parameters(), lr=ADAM["learning_rate"],
                            betas=(ADAM["beta1"], ADAM["beta2"]), eps=ADAM["eps"],
                            weight_decay=ADAM["weight_decay"])
    losses = []
    for _ in range(steps):
        total = 0.0
        for d in data:
            logits = hf(torch.tensor([d.model_input.to_ints()])).logits[0]
            loss = torch.nn.functional.cross_entropy(
                logits, torch.tensor(d.loss_fn_inputs["target_tokens"].tolist()),
                reduction="sum")
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _alone(model_dir, data, steps):
    """Bob's LoRA run (rank 4, seed 1) trained alone, in this process."""
    from helpers import make_engine

    from twinkled.protocol.types import AdamParams, Datum, ForwardBackwardRequest, LoraConfig

    eng = make_engine(model_dir)
    eng.add_adapter("bob", LoraConfig(rank=4, alpha=32, seed=1))
    rows = [Datum(d.model_input.to_ints(), {"target_tokens": d.loss_fn_inputs["target_tokens"]
                                            .to_torch()}) for d in data]
    out = []
    for _ in range(steps):
        r = eng.forward_backward([ForwardBackwardRequest("bob", rows)])[0]
        eng.optim_step("bob", AdamParams(**ADAM))
        out.append(r.metrics["loss:sum"])
    return out


@pytest.mark.filterwarnings("ignore:DEPRECATED")  # load_state: the in-place resume
def test_full_run_trains_alone_on_its_lane_beside_a_lora_tenant(two_lanes, tiny_dir, tmp_path):
    d = two_lanes
    bob = _client(d, "bob").create_lora_training_client(
        base_model=tiny_dir.name, rank=4, seed=1).result(timeout=T)
    data = _data(bob.get_tokenizer(), TEXTS)
    bob_losses = [_step(bob, data)]
    with pytest.raises(tinker.BadRequestError, match="--max-full-runs"):  # not marked
        _client(d, "bob").create_lora_training_client(base_model=tiny_dir.name,
                                                      rank=0).result(timeout=T)
    alice = _client(d, "alice")
    full = alice.create_lora_training_client(base_model=tiny_dir.name, rank=0).result(timeout=T)
    with pytest.raises(tinker.BadRequestError, match="of 2 lanes, 1 hold full runs and 1 have"):
        alice.create_lora_training_client(base_model=tiny_dir.name, rank=0).result(timeout=T)

    losses = []
    for _ in range(3):  # bob trains on the other lane meanwhile
        f = full.forward_backward(data, "cross_entropy")
        b = bob.forward_backward(data, "cross_entropy")
        losses.append(f.result(timeout=T).metrics["loss:sum"])
        bob_losses.append(b.result(timeout=T).metrics["loss:sum"])
        full.optim_step(tinker.types.AdamParams(**ADAM)).result(timeout=T)
        bob.optim_step(tinker.types.AdamParams(**ADAM)).result(timeout=T)
    assert losses == pytest.approx(_plain(tiny_dir, data, 3), rel=1e-5, abs=1e-4)
    assert losses[-1] < losses[0] and bob_losses[-1] < bob_losses[0]
    assert bob_losses == pytest.approx(_alone(tiny_dir, data, 4), rel=1e-5)

    # save_state / load_state: back to the saved weights after another step
    saved = full.save_state("s3").result(timeout=T).path
    at_save = _logprobs(full, data)
    losses_after_save = _step(full, data)
    assert _logprobs(full, data) != at_save
    full.load_state_with_optimizer(saved).result(timeout=T)
    assert _logprobs(full, data) == pytest.approx(at_save, abs=1e-6)

    # sampling from the run's weights: greedy tokens as transformers draws them from the
    # export, which loads as a plain Hugging Face model and gives the run's logprobs
    export = full.save_weights_external("hf").result(timeout=T).path
    urls = tinker.RestClient(base_url=d.url, api_key=d.keys["alice"]) \
        .get_external_weights_urls(export).result(timeout=T).urls
    assert {"config.json", "model.safetensors"} <= set(urls)
    for name, url in urls.items():
        with urllib.request.urlopen(url, timeout=60) as r:
            (tmp_path / name).write_bytes(r.read())
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = data[0].model_input.to_ints()
    with torch.no_grad():
        lp = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
        theirs = lp.gather(1, torch.tensor(data[0].loss_fn_inputs["target_tokens"].tolist())
                           [:, None])[:, 0].tolist()
        greedy = hf.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False,
                             eos_token_id=None)[0, len(ids):].tolist()
    assert theirs == pytest.approx(at_save[:len(theirs)], abs=1e-4)
    sampler = full.save_weights_and_get_sampling_client().result(timeout=T)
    got = sampler.sample(tinker.types.ModelInput.from_ints(ids), 1, tinker.types.SamplingParams(
        max_tokens=4, temperature=0.0)).result(timeout=T).sequences[0].tokens
    assert got == greedy[:len(got)] and got

    # A marked tenant (twinkled ctl tenants set) is let through the policy, to the lanes
    Target(d.data_dir, None, None).call("tenants_set", name="bob", max_full_runs=1)
    with pytest.raises(tinker.BadRequestError, match="no free lane"):
        _client(d, "bob").create_lora_training_client(base_model=tiny_dir.name,
                                                      rank=0).result(timeout=T)

    # Its lane's worker SIGKILLed: the run comes back at its acknowledged step (the journal
    # replayed over the base model), and bob's lane is untouched
    before, bob_before = _logprobs(full, data), _logprobs(bob, data)
    status = ctl_status(d.data_dir)
    assert [lane["adapters"] for lane in status["lanes"]] == [1, 1]
    pid = next(w["pid"] for w in status["workers"] if w["lane"] == 1)
    os.kill(pid, signal.SIGKILL)
    d.wait_workers(2, old={pid})
    assert _logprobs(full, data) == pytest.approx(before, abs=1e-6)
    assert _logprobs(bob, data) == bob_before

    # The session ends and frees the lane; a new run from the saved state takes it
    alice.close("success").result(timeout=T)
    _wait_lane_empty(d, 1)
    again = _client(d, "alice")
    resumed = again.create_training_client_from_state_with_optimizer(saved).result(timeout=T)
    assert _logprobs(resumed, data) == pytest.approx(at_save, abs=1e-6)
    assert _step(resumed, data) == pytest.approx(losses_after_save, rel=1e-5)

    # ... and once that one ends too, the lane is LoRA's again, over the base's own weights
    again.close("success").result(timeout=T)
    _wait_lane_empty(d, 1)
    lora = _client(d, "alice").create_lora_training_client(
        base_model=tiny_dir.name, rank=4, seed=2).result(timeout=T)  # B = 0: the base's output
    assert [lane["adapters"] for lane in ctl_status(d.data_dir)["lanes"]] == [1, 1]
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    with torch.no_grad():
        lp = base(torch.tensor([ids])).logits[0].log_softmax(-1)
    want = lp.gather(1, torch.tensor(data[0].loss_fn_inputs["target_tokens"].tolist())[:, None])
    assert _logprobs(lora, data[:1]) == pytest.approx(want[:, 0].tolist(), abs=1e-5)


def test_one_lane_daemon_refuses_a_full_run_saying_what_to_do(daemon, tiny_dir):
    sc = tinker.ServiceClient(base_url=daemon.url, api_key=daemon.keys["alice"])
    with pytest.raises(tinker.BadRequestError, match="--lanes 2 or more, or .*"
                                                     "full_run_only_lane = true"):
        sc.create_lora_training_client(base_model=tiny_dir.name, rank=0).result(timeout=T)


@pytest.fixture(scope="module")
def one_lane(tiny_dir, tmp_path_factory):
    """One lane of two CPU workers (data parallel, gloo); full runs may take it."""
    data = tmp_path_factory.mktemp("onelane")
    cfg = data / "twinkled.toml"
    cfg.write_text("full_run_only_lane = true\n")
    keys = {t: make_key(data, t) for t in ("alice", "bob")}
    d = Daemon(tiny_dir, data, data / "log", "--workers", "2", "--config", str(cfg))
    d.keys = keys
    yield d
    d.stop()


def test_a_full_run_takes_a_one_lane_daemon_when_allowed_and_gives_it_back(one_lane, tiny_dir):
    d = one_lane
    alice = _client(d, "alice")
    full = alice.create_lora_training_client(base_model=tiny_dir.name, rank=0).result(timeout=T)
    data = _data(full.get_tokenizer(), TEXTS)
    status = ctl_status(d.data_dir)
    [held] = status["full_runs"]
    assert (held["lane"], held["tenant"]) == (0, "alice") and len(status["workers"]) == 2
    assert "lane 0 held by the full-parameter run" in run_ctl(d.data_dir, "status").stdout

    # Meanwhile LoRA runs and base-model samples are 400s (never retried) naming the holder
    bob = _client(d, "bob")
    with pytest.raises(tinker.BadRequestError, match="only lane is held by a full-parameter "
                                                     "run .* of tenant 'alice'; LoRA runs"):
        bob.create_lora_training_client(base_model=tiny_dir.name, rank=4).result(timeout=T)
    base = bob.create_sampling_client(base_model=tiny_dir.name)
    base = base.result(timeout=T) if hasattr(base, "result") else base
    prompt = tinker.types.ModelInput.from_ints(data[0].model_input.to_ints())
    greedy = tinker.types.SamplingParams(max_tokens=2, temperature=0.0)
    with pytest.raises(tinker.BadRequestError, match="'alice'; base-model samples can resume"):
        base.sample(prompt, 1, greedy).result(timeout=T)

    # The run trains over both workers as plain torch AdamW does on one process
    losses = [_step(full, data) for _ in range(3)]
    assert losses == pytest.approx(_plain(tiny_dir, data, 3), rel=1e-5, abs=1e-4)
    assert losses[-1] < losses[0]

    # Its session ends: the lane is shared again, a LoRA run trains there, the base samples
    alice.close("success").result(timeout=T)
    deadline = time.monotonic() + 30
    while ctl_status(d.data_dir)["full_runs"] and time.monotonic() < deadline:
        time.sleep(0.2)
    lora = bob.create_lora_training_client(base_model=tiny_dir.name, rank=4,
                                           seed=1).result(timeout=T)
    bob_losses = [_step(lora, data) for _ in range(3)]
    assert bob_losses[-1] < bob_losses[0]
    assert base.sample(prompt, 1, greedy).result(timeout=T).sequences[0].tokens
