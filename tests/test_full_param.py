"""Full-parameter runs (rank 0, twinkled/engine/full_param.py) in the engine: the same
losses and weights as plain torch AdamW on the Hugging Face model, save/load, the HF export,
the base model back when the run ends."""

from __future__ import annotations

import pytest
import torch
from helpers import make_engine, random_datum
from transformers import AutoModelForCausalLM

from twinkled.protocol.types import AdamParams, EngineInputError, ForwardBackwardRequest, LoraConfig

PARAMS = AdamParams(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01)
QWEN3_8B = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "intermediate_size": 12288, "num_hidden_layers": 36,
            "vocab_size": 151936}


def _batch(vocab: int) -> list:
    gen = torch.Generator().manual_seed(3)
    return [random_datum(gen, n, vocab) for n in (7, 5, 9)]


def _plain_losses(model_dir, data, steps: int):
    """The reference: HF's model, summed token cross-entropy, torch.optim.AdamW."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(hf.parameters(), lr=PARAMS.learning_rate,
                            betas=(PARAMS.beta1, PARAMS.beta2), eps=PARAMS.eps,
                            weight_decay=PARAMS.weight_decay)
    losses = []
    for _ in range(steps):
        total = 0.0
        for d in data:
            logits = hf(torch.as_tensor(d.tokens)[None]).logits[0].float()
            loss = torch.nn.functional.cross_entropy(
                logits, torch.as_tensor(d.loss_inputs["target_tokens"]), reduction="sum")
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, hf


def _losses(eng, run, data, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        r = eng.forward_backward([ForwardBackwardRequest(run, data)])[0]
        assert eng.optim_step(run, PARAMS).applied
        out.append(r.metrics["loss:sum"])
    return out


@pytest.fixture(scope="module")
def trained(tiny_dir):
    eng = make_engine(tiny_dir)
    base = eng.forward([ForwardBackwardRequest(None, _batch(eng.model.vocab_size))])[0]
    info = eng.add_adapter("full", LoraConfig(rank=0))
    assert info.rank == 0
    data = _batch(eng.model.vocab_size)
    return eng, base, _losses(eng, "full", data, 3), data


def test_full_run_matches_plain_torch_adamw(tiny_dir, trained):
    eng, _, got, data = trained
    want, hf = _plain_losses(tiny_dir, data, 3)
    assert got[-1] < got[0]  # it learns the fixed batch
    assert got == pytest.approx(want, rel=1e-5, abs=1e-4)
    theirs = dict(hf.named_parameters())
    for name, p in eng.model.hf.named_parameters():
        assert torch.allclose(p, theirs[name], atol=1e-5), name


def test_export_loads_in_transformers_with_the_runs_logprobs(tiny_dir, trained, tmp_path):
    eng, _, _, data = trained
    eng.save("full", tmp_path / "ckpt")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32)
    ours = eng.forward([ForwardBackwardRequest("full", data[:1])])[0].outputs[0]["logprobs"]
    d = data[0]
    lp = torch.log_softmax(hf(torch.as_tensor(d.tokens)[None]).logits[0].float(), -1)
    theirs = lp.gather(1, torch.as_tensor(d.loss_inputs["target_tokens"])[:, None])[:, 0]
    assert torch.allclose(ours, theirs, atol=1e-5)

    # load_state: a second engine's run resumes where this one is (weights and moments)
    other = make_engine(tiny_dir)
    other.add_adapter("again", LoraConfig(rank=0))
    assert other.load("again", tmp_path / "ckpt").steps == 3
    assert _losses(other, "again", data, 1) == pytest.approx(_losses(eng, "full", data, 1),
                                                              rel=1e-6)
    with pytest.raises(EngineInputError, match="trains a full-parameter run"):
        other.add_adapter("lora", LoraConfig(rank=4))


def test_the_base_model_comes_back_when_the_run_ends(trained):
    eng, base, _, _ = trained
    eng.remove_adapter("full")
    again = eng.forward([ForwardBackwardRequest(None, _batch(eng.model.vocab_size))])[0]
    for x, y in zip(base.outputs, again.outputs, strict=True):
        assert torch.equal(x["logprobs"], y["logprobs"])
    assert not any(p.requires_grad for p in eng.model.hf.parameters())


def test_memory_estimate_refuses_an_8b_full_run_on_one_card_and_says_what_fits():
    from twinkled.protocol.sizing import GiB, full_run_problem

    qwen3_8b = QWEN3_8B
    why = full_run_problem(qwen3_8b, 2, 50 * GiB)  # what an 80 GB card leaves after bf16 weights
    assert why is not None and "8.19B parameters" in why and "14 bytes a parameter" in why
    assert "at most 3.83B parameters would fit, or a lane of 3 GPUs" in why
    assert full_run_problem(qwen3_8b, 2, 50 * GiB, ranks=4) is None  # 5 bytes a parameter
    assert full_run_problem(qwen3_8b, 2, 200 * GiB) is None
    assert full_run_problem(qwen3_8b, 2, None) is None  # no limit known (CPUs)


def test_an_8b_full_run_on_one_lane_of_two_h200s_is_admitted_with_default_settings(tmp_path):
    """The room counts the KV pool the run's lane will hold (made at the first sample and
    capped at FULL_RUN_KV_BYTES while a full run lives), not the configured pool: 30% of
    what an H200 has left (26-29 GiB) left an 8B run under the 61.0 GiB it needs. A full
    run's head keeps the whole logits, so its micro-batch counts every logit (a LoRA
    tenant's chunked head does not: the adapters' bank counts less)."""
    import json

    from twinkled.protocol.config import Config
    from twinkled.protocol.sizing import GiB, adapter_budget, full_run_problem
    from twinkled.server.layout import HEADROOM, adapters_budget, full_run_room, kv_pool_mb

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    cfg = Config(model=tmp_path, devices=["cuda:0", "cuda:1"], dtype="bfloat16")
    memory = [int(139.8 * GiB)] * 2
    cfg.sample_kv_mb = kv_pool_mb(cfg, memory)  # as `twinkled serve` sets it
    assert cfg.sample_kv_mb > 20 * 1024  # the LoRA tenants' pool is untouched
    beside_pool = adapter_budget(QWEN3_8B, memory[0], 2, cfg.token_budget, 1,
                                 cfg.sample_kv_mb << 20, HEADROOM, chunked_head=False)
    old = full_run_problem(QWEN3_8B, 2, beside_pool, ranks=2)
    assert old is not None and "GiB left" in old  # beside the tenants' pool: refused
    room = full_run_room(cfg, memory)
    assert full_run_problem(QWEN3_8B, 2, room, ranks=2) is None
    assert room == beside_pool + (cfg.sample_kv_mb << 20) - 4 * GiB
    assert room < adapters_budget(cfg, memory) + (cfg.sample_kv_mb << 20) - 4 * GiB
    assert full_run_problem(QWEN3_8B, 2, room, ranks=1) is not None  # one card: still no


def test_twinkle_sdk_r0_is_a_full_parameter_run(tiny_dir):
    import twinkle_sdk as twinkle

    twinkle.initialize(mode="local")
    m = twinkle.TransformersModel(model_id=str(tiny_dir))
    m.add_adapter_to_model("default", {"r": 0})
    m.set_optimizer("AdamW", lr=1e-3)
    rows = [{"input_ids": [9 + i, 40 + i, 70 + i, 100 + i], "labels": [-100, 40 + i, 70 + i,
                                                                       100 + i]}
            for i in range(3)]
    before = m.forward_only(inputs=rows)["loss"]
    for _ in range(2):
        m.forward_backward(inputs=rows)
        m.clip_grad_and_step()
    assert m.backend.engine.full is not None and m.backend.engine.full.steps == 2
    assert m.forward_only(inputs=rows)["loss"] < before


def test_a_full_run_takes_only_an_empty_lane_and_gives_it_back():
    from types import SimpleNamespace as NS

    from twinkled.core.exclusive import Exclusive
    from twinkled.protocol.errors import UserError

    def lane(i, models=0, parked=0):
        return NS(index=i, planner=NS(queues=NS(count=lambda: models)),
                  residency=NS(count=lambda: models,
                               tiers=NS(status=lambda: {"host": parked})))

    ex = Exclusive()
    lanes = [lane(0, models=2), lane(1, parked=1), lane(2)]
    assert ex.reserve(lanes, "run-a", "alice").index == 2
    assert ex.reserve(lanes, "run-a", "alice").index == 2  # again: the same lane
    assert [x.index for x in ex.shared(lanes)] == [0, 1] and ex.count("alice") == 1
    with pytest.raises(UserError, match="of 3 lanes, 1 hold full runs and 2 have LoRA runs"):
        ex.reserve(lanes, "run-b", "bob")  # a lane with parked adapters is not empty either
    with pytest.raises(UserError, match="--lanes 2 or more, or .*full_run_only_lane = true"):
        ex.free_lane(lanes[:1])
    ex.release("run-a")
    assert ex.count() == 0 and len(ex.shared(lanes)) == 3

    one = Exclusive(only_lane=True)  # full_run_only_lane: the one lane, when it is empty
    with pytest.raises(UserError, match="only lane has LoRA runs"):
        one.reserve(lanes[:1], "run-c", "carol")
    assert one.reserve(lanes[2:], "run-c", "carol").index == 2 and not one.shared(lanes[2:])
    with pytest.raises(UserError, match="only lane is held by a full-parameter run of tenant "
                                        "'carol'; try again when it ends"):
        one.reserve(lanes[2:], "run-d", "dave")
    assert one.status() == [{"lane": 2, "run": "run-c", "tenant": "carol"}]
    one.release("run-c")
    assert one.shared(lanes[2:]) and not one.status()


def test_sampler_views_of_a_full_run_sample_its_weights_and_go_quietly(tiny_dir, monkeypatch):
    import twinkled.engine.engine as engine_module
    from twinkled.engine.running import pool_pages
    from twinkled.protocol.types import SampleRequest, SamplingParams

    eng = make_engine(tiny_dir)
    eng.kv_bytes, cap = 4 << 20, 1 << 20  # (the configured pool, and a small cap)
    monkeypatch.setattr(engine_module, "FULL_RUN_KV_BYTES", cap)
    greedy = SamplingParams(max_tokens=3, temperature=0.0)
    eng.sample([SampleRequest(None, [5, 6, 7], greedy)])
    assert eng.kv_pages == pool_pages(eng.model, 4 << 20)  # made at the first sample
    eng.add_adapter("run", LoraConfig(rank=0))
    assert eng.kv_pages == 0  # the idle pool made before the run is let go
    eng.copy_adapter("run", "view")  # what save_weights_for_sampler keeps on the device
    data = _batch(eng.model.vocab_size)
    _losses(eng, "run", data, 1)
    got = eng.sample([SampleRequest("view", [5, 6, 7], greedy)])[0].sequences[0].tokens
    assert eng.kv_pages == pool_pages(eng.model, cap)  # the room the estimate left it
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():  # the run's current weights, as transformers runs them
        want = eng.model.hf.generate(ids, max_new_tokens=3, do_sample=False)[0, 3:].tolist()
    assert got == want[:len(got)] and got
    eng.remove_adapter("run")
    assert not eng.has_adapter("view")
    eng.sample([SampleRequest(None, [5, 6, 7], greedy)])
    assert eng.kv_pages == pool_pages(eng.model, 4 << 20)  # the run gone: the configured pool
    eng.remove_adapter("view")  # a stale view (the sampler cache lets go later): no error
    with pytest.raises(EngineInputError):
        eng.remove_adapter("view")
