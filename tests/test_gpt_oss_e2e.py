"""gpt-oss through the unmodified tinker client against a real `twinkled serve` named as
Tinker names it ("openai/gpt-oss-20b"): two tenants' adapters co-batched train alike
(same seed, same data: the same losses, step by step, so neither leaks into the other)
and the loss falls; seeded samples score as the trainer scores them (the sampler's sinks
and windows are the trainer's); two expert-parallel ranks train as one."""

from __future__ import annotations

import pytest

tinker = pytest.importorskip("tinker")

T = 120
NAME = "openai/gpt-oss-20b"
TEXT = "the sun and the sea are big and the sky is blue and wide today."


@pytest.fixture(scope="module")
def oss_daemon(tmp_path_factory):
    from daemon import Daemon, make_key

    from twinkled.engine.tiny import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("ossm") / "tiny-gpt_oss", arch="gpt_oss",
                             num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                             intermediate_size=64, num_experts=8, experts_per_token=4,
                             tie_word_embeddings=False, embed_std=0.05)
    data = tmp_path_factory.mktemp("ossd")
    d = Daemon(model, data, data / "twinkled.log", "--model-name", NAME)
    d.keys = {t: make_key(data, t) for t in ("alice", "bob")}
    d.model = model
    yield d
    d.stop()


def test_two_tenants_train_and_sample_gpt_oss(oss_daemon):
    d = oss_daemon
    clients = []
    for tenant in ("alice", "bob"):
        sc = tinker.ServiceClient(base_url=d.url, api_key=d.keys[tenant])
        clients.append(sc.create_lora_training_client(base_model=NAME, rank=4,
                                                      seed=1).result(timeout=T))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(d.model)  # (the client would fetch NAME's from the hub)
    ids = tok(TEXT).input_ids
    assert len(ids) > 8  # longer than the tiny model's window
    datum = tinker.types.Datum(
        model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})
    adam = tinker.types.AdamParams(learning_rate=2e-2)
    losses = {0: [], 1: []}
    for _ in range(6):  # both tenants' steps in flight together: co-batched
        fb = [c.forward_backward([datum], "cross_entropy") for c in clients]
        for i, f in enumerate(fb):
            losses[i].append(f.result(timeout=T).metrics["loss:sum"])
        for f in [c.optim_step(adam) for c in clients]:
            f.result(timeout=T)
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert losses[0][-1] < 0.7 * losses[0][0], losses[0]

    sampler = clients[0].save_weights_and_get_sampling_client().result(timeout=T)
    prompt = tinker.types.ModelInput.from_ints(ids[:3])
    params = tinker.types.SamplingParams(max_tokens=10, temperature=1.0, seed=3)
    got = sampler.sample(prompt, 2, params).result(timeout=T)
    assert len(got.sequences) == 2
    for s in got.sequences:
        full = tinker.types.ModelInput.from_ints(ids[:3] + list(s.tokens))
        scored = sampler.compute_logprobs(full).result(timeout=T)[3:]
        assert s.logprobs == pytest.approx(scored, abs=1e-4)


def _three_steps(d, key: str) -> dict:
    """Three SFT steps of one tenant and a greedy sample of its adapter."""
    from transformers import AutoTokenizer

    sc = tinker.ServiceClient(base_url=d.url, api_key=key)
    tc = sc.create_lora_training_client(base_model=NAME, rank=4, seed=2).result(timeout=T)
    ids = AutoTokenizer.from_pretrained(d.model)(TEXT).input_ids
    datum = tinker.types.Datum(
        model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})
    losses = []
    for _ in range(3):
        losses.append(tc.forward_backward([datum], "cross_entropy").result(timeout=T)
                      .metrics["loss:sum"])
        tc.optim_step(tinker.types.AdamParams(learning_rate=2e-2)).result(timeout=T)
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=T)
    seq = sampler.sample(tinker.types.ModelInput.from_ints(ids[:3]), 1,
                         tinker.types.SamplingParams(max_tokens=8, temperature=0.0)
                         ).result(timeout=T).sequences[0]
    return {"losses": losses, "tokens": seq.tokens, "lp": seq.logprobs}


def test_expert_parallel_ranks_train_as_one(oss_daemon, tmp_path):
    """--workers 2 --ep 2: each rank holds half of every layer's biased experts; the pair
    trains and samples as the one-rank daemon does (engine-level --tp 2, which splits the
    heads and their sinks too, is tests/test_engine_tp.py's)."""
    from daemon import Daemon, make_key

    one = _three_steps(oss_daemon, oss_daemon.keys["alice"])
    d = Daemon(oss_daemon.model, tmp_path, tmp_path / "twinkled.log", "--model-name", NAME,
               "--workers", "2", "--ep", "2")
    try:
        d.model = oss_daemon.model
        split = _three_steps(d, make_key(tmp_path, "carol"))
    finally:
        d.stop()
    assert one["losses"][-1] < one["losses"][0]
    assert split["losses"] == pytest.approx(one["losses"], rel=1e-4)
    assert split["tokens"] == one["tokens"]
    assert split["lp"] == pytest.approx(one["lp"], abs=1e-4)
