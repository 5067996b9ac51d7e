"""Qwen3.5 through the unmodified tinker client against a real `twinkled serve`: two
tenants train (loss falls), sample from their adapters, and the sampler's logprobs equal
the trainer's on the same tokens (the linear-attention state carried through decode);
tinker-cookbook's RL loop (its `rl_loop` defaults to Qwen3.5) raises the reward."""

from __future__ import annotations

import pytest

tinker = pytest.importorskip("tinker")

T = 120
TEXT = "the sun and the sea are big."


@pytest.fixture(scope="module")
def q35_daemon(tmp_path_factory):
    from daemon import Daemon, make_key

    from twinkled.engine.tiny import build_tiny_model

    # Small embeddings: broad next-token distributions, so sampling at T=1 explores (RL).
    model = build_tiny_model(tmp_path_factory.mktemp("q35m") / "tiny-qwen3_5", arch="qwen3_5",
                             num_layers=4, embed_std=0.02)
    data = tmp_path_factory.mktemp("q35d")
    d = Daemon(model, data, data / "twinkled.log")
    d.keys = {t: make_key(data, t) for t in ("alice", "bob")}
    d.model = model
    yield d
    d.stop()


def test_two_tenants_train_and_sample_qwen35(q35_daemon):
    d = q35_daemon
    clients = []
    for tenant in ("alice", "bob"):
        sc = tinker.ServiceClient(base_url=d.url, api_key=d.keys[tenant])
        clients.append(sc.create_lora_training_client(base_model=d.model.name, rank=4,
                                                      seed=1).result(timeout=T))
    tok = clients[0].get_tokenizer()
    ids = tok(TEXT).input_ids
    datum = tinker.types.Datum(
        model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})
    adam = tinker.types.AdamParams(learning_rate=2e-2)
    losses = {0: [], 1: []}
    for _ in range(8):  # both tenants' steps in flight together: co-batched
        fb = [c.forward_backward([datum], "cross_entropy") for c in clients]
        for i, f in enumerate(fb):
            losses[i].append(f.result(timeout=T).metrics["loss:sum"])
        for f in [c.optim_step(adam) for c in clients]:
            f.result(timeout=T)
    for i in losses:
        assert losses[i][-1] < 0.7 * losses[i][0], losses[i]

    sampler = clients[0].save_weights_and_get_sampling_client().result(timeout=T)
    prompt = tinker.types.ModelInput.from_ints(ids[:3])
    params = tinker.types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    got = sampler.sample(prompt, 2, params).result(timeout=T)
    assert len(got.sequences) == 2
    for s in got.sequences:
        full = tinker.types.ModelInput.from_ints(ids[:3] + list(s.tokens))
        scored = sampler.compute_logprobs(full).result(timeout=T)[3:]
        # The sampler steps the delta rule's recurrence a token at a time, the scorer runs
        # its chunked form: in fp32 they round differently, and the tiny model's state
        # carries it (2.3e-4 nats at one token of -6.26, for the weights one co-batching
        # of the 8 training steps gives; under 1e-4 for another's).
        assert s.logprobs == pytest.approx(scored, abs=5e-4)


def test_cookbook_rl_loop_on_qwen35_raises_the_reward(q35_daemon, tmp_path, monkeypatch):
    """The cookbook test's toy task (tests/test_cookbook_rl.py) on the tiny Qwen3.5."""
    pytest.importorskip("tinker_cookbook")
    from test_cookbook_rl import assert_toy_reward_rises
    from tinker_cookbook import tokenizer_utils
    from transformers import AutoTokenizer

    d = q35_daemon
    tokenizer_utils.register_tokenizer(d.model.name, lambda: AutoTokenizer.from_pretrained(d.model))
    monkeypatch.setenv("TINKER_API_KEY", d.keys["alice"])
    assert_toy_reward_rises(d.url, d.model.name, tmp_path / "run")
