"""The unmodified tinker 0.38 client against a real `twinkled serve` process."""

from __future__ import annotations

import math
import os
import threading

import pytest

tinker = pytest.importorskip("tinker")
os.environ.setdefault("TINKER_TELEMETRY", "0")

T = 120  # seconds: every .result() has a timeout, so a broken server fails, not hangs
SENTENCES = ["the sun and the sea are big.", "hello world from twinkle, yes."]


def service(daemon, tenant="alice"):
    return tinker.ServiceClient(base_url=daemon.url, api_key=daemon.keys[tenant])


def datum(tok, text: str, **extra):
    ids = tok(text).input_ids
    n = len(ids) - 1
    inputs = {"target_tokens": ids[1:], "weights": [1.0] * n}
    inputs.update({k: v(n) if callable(v) else v for k, v in extra.items()})
    return tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
                              loss_fn_inputs=inputs)


def trained_client(sc, tiny_dir, rank=8, steps=0, lr=5e-3, seed=None):
    tc = sc.create_lora_training_client(base_model=tiny_dir.name, rank=rank,
                                        seed=seed).result(timeout=T)
    tok = tc.get_tokenizer()
    data = [datum(tok, s) for s in SENTENCES]
    losses = []
    for _ in range(steps):
        losses.append(tc.forward_backward(data, "cross_entropy").result(timeout=T).metrics["loss:sum"])
        tc.optim_step(tinker.types.AdamParams(learning_rate=lr)).result(timeout=T)
    return tc, tok, data, losses


def greedy(sampler, tok, text, n):
    prompt = tinker.types.ModelInput.from_ints(tok(text).input_ids)
    params = tinker.types.SamplingParams(max_tokens=n, temperature=0.0)
    return sampler.sample(prompt, 1, params).result(timeout=T).sequences[0]


def test_sft_memorises_and_greedy_sampling_reproduces(daemon, tiny_dir):
    sc = service(daemon)
    tc, tok, data, losses = trained_client(sc, tiny_dir, seed=0)
    adam = tinker.types.AdamParams(learning_rate=5e-3)
    for _ in range(150):  # about 60 steps are needed; stop once memorised
        loss = tc.forward_backward(data, "cross_entropy").result(timeout=T).metrics["loss:sum"]
        losses.append(loss)
        if loss < 0.2:
            break
        tc.optim_step(adam).result(timeout=T)
    assert losses[-1] < 0.2 < losses[0], losses[::10]
    sampler = tc.save_weights_and_get_sampling_client()
    for s in SENTENCES:
        head, tail = s.split(" ", 2)[:2], s.split(" ", 2)[2]
        prefix = " ".join(head)
        want = tok(s).input_ids[len(tok(prefix).input_ids):]
        got = greedy(sampler, tok, prefix, len(want))
        assert tok.decode(got.tokens) == tok.decode(want), tail
    sc.close("success")


def test_forward_matches_forward_backward_and_changes_nothing(daemon, tiny_dir):
    sc = service(daemon)
    tc, tok, data, _ = trained_client(sc, tiny_dir, steps=1)
    f1 = tc.forward(data, "cross_entropy").result(timeout=T)
    # An optim_step after a forward has no gradients to apply: the forward left none.
    res = tc.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result(timeout=T)
    assert res.metrics.get("skipped:sum") == 1.0
    f2 = tc.forward(data, "cross_entropy").result(timeout=T)
    fb = tc.forward_backward(data, "cross_entropy").result(timeout=T)
    for a, b in zip(f1.loss_fn_outputs, fb.loss_fn_outputs, strict=True):
        assert a["logprobs"].tolist() == pytest.approx(b["logprobs"].tolist(), abs=1e-5)
    assert f1.metrics["loss:sum"] == pytest.approx(f2.metrics["loss:sum"], abs=1e-5)
    assert all(":" in k for k in fb.metrics)


def test_chunked_call_accumulates_like_separate_calls(daemon, tiny_dir):
    """5 datums with fwdbwd_max_chunk_len=2 go out as 3 concurrent chunks, first last."""
    sc = service(daemon)
    texts = ["a b c d e", "the sun", "hello there world", "yes no", "five six seven eight"]
    one = sc.create_lora_training_client(base_model=tiny_dir.name, rank=4, seed=3).result(timeout=T)
    two = sc.create_lora_training_client(base_model=tiny_dir.name, rank=4, seed=3).result(timeout=T)
    tok = one.get_tokenizer()
    data = [datum(tok, t) for t in texts]
    route = {"route": "/api/v1/forward_backward", "status": "200"}
    calls = daemon.metric("twinkle_requests_total", **route)
    whole = one.forward_backward(data, "cross_entropy").result(timeout=T).metrics["loss:sum"]
    assert daemon.metric("twinkle_requests_total", **route) - calls == 3  # 2 + 2 + 1 datums
    parts = sum(two.forward_backward([d], "cross_entropy").result(timeout=T).metrics["loss:sum"]
                for d in data)
    assert whole == pytest.approx(parts, rel=1e-5)
    adam = tinker.types.AdamParams(learning_rate=1e-2)
    one.optim_step(adam).result(timeout=T)
    two.optim_step(adam).result(timeout=T)
    after1 = one.forward(data, "cross_entropy").result(timeout=T).metrics["loss:sum"]
    after2 = two.forward(data, "cross_entropy").result(timeout=T).metrics["loss:sum"]
    assert after1 == pytest.approx(after2, rel=1e-4)  # same accumulated gradients


def _rl_loss(loss, config, lp, q, adv):
    """Tinker's per-token formulas (docs, "Loss functions"), summed: written out here, not
    taken from the engine."""
    config = config or {}
    lo, hi = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    total = 0.0
    for t_lp, t_q, a in zip(lp, q, adv, strict=True):
        r = math.exp(t_lp - t_q)
        total += {"importance_sampling": -r * a,
                  "ppo": -min(r * a, min(max(r, lo), hi) * a),
                  "cispo": -min(max(r, lo), hi) * t_lp * a,
                  "dro": -(t_lp * a - 0.5 * config.get("beta", 0.05) * (t_lp - t_q) ** 2)}[loss]
    return total


@pytest.mark.parametrize(("loss", "config"), [
    ("importance_sampling", None), ("ppo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}),
    ("cispo", None), ("dro", {"beta": 0.1}),
])
def test_rl_losses_run(daemon, tiny_dir, loss, config):
    """Each RL loss through the client: loss:sum is the documented formula's, on sampler
    logprobs put around the model's own so the ratios fall below, inside and above the
    clip range, and the loss's config reaches the engine."""
    sc = service(daemon, "bob")
    tc, tok, plain, _ = trained_client(sc, tiny_dir, rank=4)
    lps = [o["logprobs"].tolist() for o in
           tc.forward(plain, "cross_entropy").result(timeout=T).loss_fn_outputs]
    shifts = [-0.6, -0.1, 0.5, 0.05]  # ratios e^0.6, e^0.1, e^-0.5, e^-0.05 in turn
    data, want = [], 0.0
    for d, lp in zip(plain, lps, strict=True):
        q = [x + shifts[i % 4] for i, x in enumerate(lp)]
        adv = [(-1.0) ** i * (0.5 + i / 10) for i in range(len(lp))]
        data.append(tinker.types.Datum(model_input=d.model_input, loss_fn_inputs={
            "target_tokens": d.loss_fn_inputs["target_tokens"], "logprobs": q,
            "advantages": adv}))
        want += _rl_loss(loss, config, lp, q, adv)
    out = tc.forward_backward(data, loss, config).result(timeout=T)
    assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-4, abs=1e-4)
    assert tc.optim_step(tinker.types.AdamParams(learning_rate=1e-3)).result(timeout=T).metrics


def test_unknown_loss_is_a_clear_user_error(daemon, tiny_dir):
    sc = service(daemon)
    tc, tok, data, _ = trained_client(sc, tiny_dir, rank=4)
    with pytest.raises((tinker.RequestFailedError, tinker.BadRequestError), match="unknown loss 'nope'"):
        tc.forward_backward(data, "nope").result(timeout=T)
    # The model still works afterwards.
    assert tc.forward_backward(data, "cross_entropy").result(timeout=T).metrics["loss:sum"] > 0


def test_save_state_and_resume_with_optimizer(daemon, tiny_dir):
    sc = service(daemon)
    tc, tok, data, _ = trained_client(sc, tiny_dir, steps=3)
    path = tc.save_state("after-3").result(timeout=T).path
    assert path.startswith("tinker://") and path.endswith("/weights/after-3")
    adam = tinker.types.AdamParams(learning_rate=5e-3)
    tc.forward_backward(data, "cross_entropy").result(timeout=T)
    tc.optim_step(adam).result(timeout=T)
    want = tc.forward(data, "cross_entropy").result(timeout=T).metrics["loss:sum"]

    resumed = sc.create_training_client_from_state_with_optimizer(path).result(timeout=T)
    session = sc.holder.get_session_id() if hasattr(sc, "holder") else None
    assert ":train:" in resumed.model_id and (session is None or resumed.model_id.startswith(session))
    resumed.forward_backward(data, "cross_entropy").result(timeout=T)
    resumed.optim_step(adam).result(timeout=T)
    got = resumed.forward(data, "cross_entropy").result(timeout=T).metrics["loss:sum"]
    assert got == pytest.approx(want, rel=1e-5)


def test_sampling_stop_strings_seeds_and_compute_logprobs(daemon, tiny_dir):
    sc = service(daemon)
    tc, tok, data, _ = trained_client(sc, tiny_dir, steps=2)
    path = tc.save_weights_for_sampler("s1").result(timeout=T).path
    sampler = sc.create_sampling_client(model_path=path)
    prompt = tinker.types.ModelInput.from_ints(tok("the sun").input_ids)
    seeded = tinker.types.SamplingParams(max_tokens=8, temperature=1.0, seed=42, stop=[])
    a = sampler.sample(prompt, 3, seeded).result(timeout=T)
    b = sampler.sample(prompt, 3, seeded).result(timeout=T)
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert all(s.sequence_id for s in a.sequences)
    free = greedy(sampler, tok, "the sun", 8)
    text = tok.decode(free.tokens[2:4])
    stopped = sampler.sample(prompt, 1, tinker.types.SamplingParams(
        max_tokens=8, temperature=0.0, stop=[text])).result(timeout=T).sequences[0]
    assert stopped.stop_reason == "stop" and text in tok.decode(stopped.tokens)
    lps = sampler.compute_logprobs(prompt).result(timeout=T)
    assert lps[0] is None and len(lps) == len(prompt.to_ints())
    fwd = tc.forward([tinker.types.Datum(
        model_input=tinker.types.ModelInput.from_ints(prompt.to_ints()[:-1]),
        loss_fn_inputs={"target_tokens": prompt.to_ints()[1:]})], "cross_entropy").result(timeout=T)
    assert lps[1:] == pytest.approx(fwd.loss_fn_outputs[0]["logprobs"].tolist(), abs=1e-4)
    base = sc.create_sampling_client(base_model=tiny_dir.name)
    assert len(base.sample(prompt, 1, seeded).result(timeout=T).sequences[0].tokens) == 8


def test_rest_listings(daemon, tiny_dir):
    sc = service(daemon, "bob")
    tc, _, _, _ = trained_client(sc, tiny_dir, rank=4, steps=1)
    tc.save_state("r1").result(timeout=T)
    tc.save_weights_for_sampler("r1s").result(timeout=T)
    rest = sc.create_rest_client()
    runs = rest.list_training_runs().result(timeout=T)
    assert tc.model_id in [r.training_run_id for r in runs.training_runs]
    ckpts = rest.list_checkpoints(tc.model_id).result(timeout=T).checkpoints
    assert {c.checkpoint_id for c in ckpts} == {"weights/r1", "sampler_weights/r1s"}
    assert all(c.size_bytes and c.size_bytes > 0 for c in ckpts)
    run = rest.get_training_run(tc.model_id).result(timeout=T)
    assert run.lora_rank == 4 and run.last_checkpoint.checkpoint_id == "weights/r1"
    mine = rest.list_user_checkpoints().result(timeout=T).checkpoints
    assert {"weights/r1", "sampler_weights/r1s"} <= {c.checkpoint_id for c in mine}
    rest.delete_checkpoint(tc.model_id, "sampler_weights/r1s").result(timeout=T)
    ckpts = rest.list_checkpoints(tc.model_id).result(timeout=T).checkpoints
    assert {c.checkpoint_id for c in ckpts} == {"weights/r1"}


def test_four_clients_of_two_tenants_train_at_once(daemon, tiny_dir):
    results, errors = {}, []

    def run(tenant, rank, loss_fn):
        try:
            sc = service(daemon, tenant)
            tc, tok, data, losses = trained_client(sc, tiny_dir, rank=rank, steps=6, lr=1e-2,
                                                   seed=rank)
            results[(tenant, rank)] = losses
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=a) for a in
               [("alice", 2, "ce"), ("alice", 8, "ce"), ("bob", 4, "ce"), ("bob", 16, "ce")]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    assert len(results) == 4
    assert all(v[-1] < v[0] for v in results.values())
    # Exact, not only lower: one of them trained again alone (same seed, same data) has
    # the same losses step by step, so nothing leaked between the co-batched tenants.
    _, _, _, alone = trained_client(service(daemon, "bob"), tiny_dir, rank=16, steps=6,
                                    lr=1e-2, seed=16)
    assert results[("bob", 16)] == pytest.approx(alone, rel=1e-4, abs=1e-5)


def test_sampler_checkpoint_saved_again_serves_the_new_weights(daemon, tiny_dir):
    sc = service(daemon)
    tc, tok, data, _ = trained_client(sc, tiny_dir, steps=1)
    prompt = tinker.types.ModelInput.from_ints(tok("the sun and the sea").input_ids)
    path = tc.save_weights_for_sampler("same").result(timeout=T).path
    before = sc.create_sampling_client(model_path=path).compute_logprobs(prompt).result(timeout=T)
    for _ in range(5):
        tc.forward_backward(data, "cross_entropy").result(timeout=T)
        tc.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result(timeout=T)
    assert tc.save_weights_for_sampler("same").result(timeout=T).path == path
    after = sc.create_sampling_client(model_path=path).compute_logprobs(prompt).result(timeout=T)
    ids = prompt.to_ints()
    fwd = tc.forward([tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
                                         loss_fn_inputs={"target_tokens": ids[1:]})],
                     "cross_entropy").result(timeout=T).loss_fn_outputs[0]["logprobs"].tolist()
    assert after[1:] == pytest.approx(fwd, abs=1e-4)
    assert after[1:] != pytest.approx(before[1:], abs=1e-3)


def test_a_request_cut_into_pieces_fails_whole_on_one_bad_datum(daemon, tiny_dir):
    """The daemon's steps hold 24 tokens: this 2-datum request (one client chunk) runs in
    two pieces. A bad last datum fails the whole request before any piece trains."""
    sc = service(daemon)
    tc, tok, data, _ = trained_client(sc, tiny_dir, rank=4)
    good = [datum(tok, "the sun and the sea are big and the sea is blue, and so the sun "
                       "is hot and the sea is big")]
    assert len(good[0].model_input.to_ints()) + 3 > 24  # so the two datums are cut apart
    bad = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([5, 6, 10**6]),
                             loss_fn_inputs={"target_tokens": [6, 7, 8]})
    with pytest.raises((tinker.RequestFailedError, tinker.BadRequestError), match="outside the vocabulary"):
        tc.forward_backward(good + [bad], "cross_entropy").result(timeout=T)
    before = tc.forward(good, "cross_entropy").result(timeout=T).metrics["loss:sum"]
    res = tc.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result(timeout=T)
    assert res.metrics.get("skipped:sum") == 1.0  # no gradients were left behind
    after = tc.forward(good, "cross_entropy").result(timeout=T).metrics["loss:sum"]
    assert after == pytest.approx(before)


def test_a_client_gone_mid_body_is_a_499_not_a_server_error(daemon):
    """A client killed while sending its request (a body shorter than its Content-Length,
    then the connection closed): the daemon logs a 499 for it, no traceback, and serves on."""
    import socket
    import time
    import urllib.request

    start = len(daemon.log_path.read_text(errors="replace"))  # (a daemon other tests share)

    def new_log() -> str:
        return daemon.log_path.read_text(errors="replace")[start:]

    with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as s:
        s.sendall(b"POST /api/v1/retrieve_future HTTP/1.1\r\nHost: x\r\n"
                  b"X-API-Key: " + daemon.keys["alice"].encode() + b"\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"requ")
        time.sleep(0.5)  # (the handler is reading the body)
    deadline = time.time() + 30
    while " 499 " not in new_log():
        assert time.time() < deadline, "no 499 logged for the cut request"
        time.sleep(0.2)
    assert "Error handling request" not in new_log() and "ConnectionResetError" not in new_log()
    with urllib.request.urlopen(f"{daemon.url}/api/v1/healthz", timeout=10) as r:
        assert r.status == 200
