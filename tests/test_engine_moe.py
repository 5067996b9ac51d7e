"""Mixture-of-experts base models (engine/moe.py): routing and experts as transformers runs
them, per-expert LoRA for many adapters in one pass, peft's form on export, sampling."""

from __future__ import annotations

import pytest
import torch
from helpers import all_close, ce_request, grads, make_engine, randomize_b, weights
from running_checks import assert_running_batch_equals_padded, assert_same_samples, mixed_requests

from twinkled.engine.lora import LoraBatch
from twinkled.engine.moe_peft import from_peft, peft_module
from twinkled.protocol.types import (
    AdamParams,
    DimuonParams,
    EngineInputError,
    LoraConfig,
    SampleRequest,
    SamplingParams,
)

EXPERT_KEY = "model.layers.0.mlp.experts.gate_up_proj"


def _engine(moe_dir, **kw):
    eng = make_engine(moe_dir, **kw)
    eng.add_adapter("a", LoraConfig(rank=4, alpha=8, seed=1))
    eng.add_adapter("b", LoraConfig(rank=8, seed=2, train_attn=False))  # another bank
    eng.add_adapter("c", LoraConfig(rank=4, alpha=8, seed=3))
    for i, name in enumerate("abc"):
        randomize_b(eng, name, seed=10 + i, std=0.2)  # so every delta is visible
    return eng


def _logits(eng, adapter, ids):
    a = None if adapter is None else eng.pool.get(adapter)
    lora = LoraBatch([a] * ids.shape[0], eng.model.dtype, eng.model.device)
    pos = torch.arange(ids.shape[1], device=eng.model.device).expand(ids.shape[0], -1)
    with torch.no_grad():
        return eng.model.logits(eng.model.forward(ids.to(eng.model.device), pos, lora), lora).cpu()


def test_base_forward_matches_transformers(moe_dir):
    from transformers import AutoModelForCausalLM

    eng = make_engine(moe_dir)
    assert sorted(eng.model.moe) == [0, 1]
    assert eng.model.targets[EXPERT_KEY] == (128, 128, 8)  # (in, out, experts)
    hf = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, eng.model.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
    assert (_logits(eng, None, ids) - want).abs().max() <= 1e-5


@pytest.mark.parametrize("max_groups", [None, 8])
def test_cobatched_gradients_equal_each_adapter_alone(moe_dir, monkeypatch, max_groups):
    """Packed rows of three adapters in two banks and a base-model row, against each alone
    (single-datum requests run padded: both LoRA layouts are exercised). With max_groups
    8 (one adapter's 8 experts), a bank's adapters run in parts, as a GPU's grouped matmul
    needs for 128 experts x 8 adapters."""
    if max_groups is not None:
        import twinkled.engine.moe as moe

        monkeypatch.setattr(moe, "MAX_GROUPS", max_groups)
    gen = torch.Generator().manual_seed(0)
    V = 1024
    reqs = [ce_request("a", gen, V, [7, 12]), ce_request("b", gen, V, [9]),
            ce_request("c", gen, V, [5, 3, 11]), ce_request(None, gen, V, [6], forward_only=True)]
    together = _engine(moe_dir)
    out = together.forward_backward(reqs)
    alone = _engine(moe_dir)
    for i, name in enumerate("abc"):
        ref = alone.forward_backward([reqs[i]])[0]
        assert out[i].metrics["loss:sum"] == pytest.approx(ref.metrics["loss:sum"], rel=1e-5)
        g, h = grads(together, name), grads(alone, name)
        assert EXPERT_KEY in g and g[EXPERT_KEY][0].abs().max() > 0
        for k in g:
            for x, y in zip(g[k], h[k], strict=True):
                assert (x - y).abs().max() <= 1e-5 * max(1.0, y.abs().max()), (name, k)
    assert "model.layers.0.self_attn.q_proj" not in grads(together, "b")  # train_attn=False


def test_export_loads_in_peft_with_the_same_logits_and_gradients(moe_dir, tmp_path):
    """peft's target_parameters form: same logprobs, and its autograd gives our gradients."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    eng = _engine(moe_dir)
    eng.save("a", tmp_path / "a", optimizer=False)
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert cfg["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    base = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    pm = PeftModel.from_pretrained(base, tmp_path / "a", is_trainable=True)
    gen = torch.Generator().manual_seed(3)
    req = ce_request("a", gen, eng.model.vocab_size, [14])
    ids = torch.as_tensor(req.data[0].tokens)[None]
    logits = pm(input_ids=ids).logits
    ours = _logits(eng, "a", ids)
    assert (ours - _logits(eng, None, ids)).abs().max() > 1e-2  # the adapter matters
    # fp32, relative: the fused q/k/v LoRA (lora_fused.py) sums in another order than peft
    assert (ours - logits.detach()).abs().max() <= 1e-5 * max(1.0, logits.abs().max().item())

    lp = torch.log_softmax(logits[0].float(), -1).gather(
        1, torch.as_tensor(req.data[0].loss_inputs["target_tokens"])[:, None])
    (-lp.sum()).backward()
    eng.forward_backward([req])
    mine = grads(eng, "a")
    params = dict(pm.named_parameters())
    for key, shape in eng.pool.get("a").bank.shapes.items():
        name = f"base_model.model.{peft_module(key)}.lora_%s.default.weight"
        ga, gb = from_peft(key, params[name % "A"].grad, params[name % "B"].grad, 4, shape)
        assert all_close({key: mine[key]}, {key: (ga, gb)}), key


def test_checkpoint_and_live_state_round_trip(moe_dir, tmp_path):
    from twinkled.engine.live import write_live
    from twinkled.engine.state import snapshot

    eng = _engine(moe_dir)
    eng.forward_backward([ce_request("a", torch.Generator().manual_seed(1), 1024, [8])])
    eng.optim_step("a", AdamParams(learning_rate=1e-2))
    eng.save("a", tmp_path / "ckpt", optimizer=True)
    eng.load("copy", tmp_path / "ckpt", optimizer=True)
    write_live(snapshot(eng.pool.get("a"), True), tmp_path / "live")
    eng.load("live", tmp_path / "live")
    want = weights(eng, "a")
    for other in ("copy", "live"):
        got = weights(eng, other)
        assert all(torch.equal(got[k][i], want[k][i]) for k in want for i in range(2))
        a, b = eng.pool.get("a"), eng.pool.get(other)
        assert torch.equal(b.bank.vA[EXPERT_KEY][b.slot], a.bank.vA[EXPERT_KEY][a.slot])


@pytest.mark.parametrize("params", [AdamParams(learning_rate=2e-2),
                                    DimuonParams(learning_rate=2e-2)], ids=["adamw", "dimuon"])
def test_training_lowers_the_loss(moe_dir, params):
    eng = make_engine(moe_dir)
    eng.add_adapter("a", LoraConfig(rank=8, seed=1, optimizer=params.__struct_config__.tag))
    req = ce_request("a", torch.Generator().manual_seed(2), 1024, [16, 16])
    losses = []
    for _ in range(4):
        losses.append(eng.forward_backward([req])[0].metrics["loss:sum"])
        assert eng.optim_step("a", params).applied
    assert losses[-1] < losses[0] * 0.9


def test_greedy_samples_follow_the_adapter(moe_dir):
    eng = _engine(moe_dir)
    prompt = [5, 9, 33, 70]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, stop=[])
    reqs = [SampleRequest(n, prompt, greedy) for n in ("a", "b", None)]
    together = eng.sample(reqs)
    for req, res in zip(reqs, together, strict=True):
        seq = res.sequences[0]
        alone = eng.sample([req])[0].sequences[0]
        assert seq.tokens == alone.tokens
        ids = torch.tensor([prompt + seq.tokens[:-1]])
        logp = torch.log_softmax(_logits(eng, req.adapter_id, ids)[0, len(prompt) - 1:], -1)
        assert logp.argmax(-1).tolist() == seq.tokens
        assert torch.allclose(logp.max(-1).values, torch.tensor(seq.logprobs), atol=1e-4)
    assert together[0].sequences[0].logprobs != together[2].sequences[0].logprobs  # adapter used


def test_running_batch_samples_as_the_padded_sampler(moe_dir):
    """Qwen3-MoE samples in the running batch (eager decode: its routing is data-dependent)
    with each row's expert LoRA; both prefill layouts (the padded one once crashed:
    bank_tokens took its RowLora for a packed batch) and a prefix-cache hit give the padded
    sampler's samples."""
    eng = _engine(moe_dir)
    assert not eng.padded_sampling
    assert_running_batch_equals_padded(eng)
    # Decode slices (workers/sampling.py's between training steps): submitted in two
    # parts, run 2 steps at a time, they give what one blocking `sample` gives.
    reqs = mixed_requests(eng.model.vocab_size, ("a", "c"))
    want = eng.sample(reqs)
    tickets = eng.sample_submit(reqs[:2])
    assert eng.sample_slice(max_steps=2) == []
    tickets += eng.sample_submit(reqs[2:])
    done = {}
    while len(done) < len(tickets):
        done.update((f.ticket, f.result) for f in eng.sample_slice(max_steps=2))
    assert_same_samples([done[t] for t in tickets], want)


def test_unknown_moe_layouts_are_refused(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    from twinkled.engine.tiny import build_tokenizer

    tok = build_tokenizer(tmp_path)
    cfg = Qwen2MoeConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                         moe_intermediate_size=16, shared_expert_intermediate_size=16,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         num_experts=4, num_experts_per_tok=2)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    with pytest.raises(EngineInputError, match="'qwen2_moe' is not supported.*qwen3_moe"):
        make_engine(tmp_path)


def test_ep_must_divide_the_experts(moe_dir):
    from twinkled.engine.moe_parallel import ExpertSplit

    with pytest.raises(EngineInputError, match="ep=3 does not divide the 8 experts"):
        make_engine(moe_dir, experts=ExpertSplit(0, 3, None))


def test_mixtral_shares_the_layout(tmp_path):
    """Mixtral's router always renormalises its top-k; no q/k norms. Same logits as HF;
    its running batch samples as the padded sampler."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    from twinkled.engine.tiny import build_tokenizer

    tok = build_tokenizer(tmp_path)
    cfg = MixtralConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=32,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        num_local_experts=4, num_experts_per_tok=2, head_dim=16)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    hf.save_pretrained(tmp_path)
    eng = make_engine(tmp_path)
    assert sorted(eng.model.moe) == [0, 1]
    ids = torch.randint(0, len(tok), (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
    assert (_logits(eng, None, ids) - want).abs().max() <= 1e-5
    for seed, name in enumerate("ab"):
        eng.add_adapter(name, LoraConfig(rank=4, alpha=8, seed=seed))
        randomize_b(eng, name, seed=10 + seed, std=0.2)
    assert_running_batch_equals_padded(eng, prefills=("varlen",))


def test_an_unknown_expert_layout_is_refused():
    """A sparse block with more than router + fused experts (here Qwen2-MoE's shared expert)
    under a model type we know is refused, naming what was found."""
    from types import SimpleNamespace

    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    from twinkled.engine.moe import moe_blocks

    cfg = Qwen2MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=4,
                         num_experts_per_tok=2, shared_expert_intermediate_size=16)
    layer = SimpleNamespace(mlp=Qwen2MoeSparseMoeBlock(cfg))
    with pytest.raises(EngineInputError, match="layer 0: MoE layout .*shared_expert"):
        moe_blocks("qwen3_moe", cfg, [layer])


def test_a_peft_made_expert_adapter_loads(moe_dir, tmp_path):
    """peft's own target_parameters adapter (q, v and the experts) loads with its logits."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    pm = get_peft_model(hf, PeftLoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    for n, p in pm.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    pm.save_pretrained(tmp_path)
    eng = make_engine(moe_dir)
    assert eng.load("x", tmp_path, optimizer=False).rank == 4
    ids = torch.randint(0, eng.model.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = pm(input_ids=ids).logits
    assert (_logits(eng, "x", ids) - want).abs().max() <= 1e-5
    assert (_logits(eng, None, ids) - want).abs().max() > 1e-2
