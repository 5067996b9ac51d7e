"""Tensor parallelism on the CPU: two gloo ranks at tp=2 give what one rank gives.

The group runs tests/tp_scenario.py (mixed-adapter training, an optimizer step, greedy and
seeded sampling, a checkpoint) in two processes; this process runs the same scenario on a
whole engine and compares: fp32, relative 1e-4. The checkpoint written under tp=2 loads
under tp=1 and in peft."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from daemon import free_port
from helpers import rel_diff
from tp_scenario import run

from twinkled.engine.engine import Engine
from twinkled.engine.lora import LoraBatch
from twinkled.engine.tiny import build_tiny_model
from twinkled.protocol.types import LoraConfig

# Whether megatron-core is installed, without importing it (seconds of CPU in every test
# process that collects this file; the tp ranks import it themselves).
pytestmark = pytest.mark.skipif(find_spec("megatron.core") is None,
                                reason="megatron-core is not installed (the megatron extra)")
HERE = Path(__file__).parent
RTOL = 1e-4


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """Tiny models (qwen3: 2 heads, 1 KV head, replicated, tied embeddings split over the
    vocabulary; qwen2: 4 heads, 2 KV heads, split, with qkv biases, an untied lm_head;
    llama: 4 heads, 1 KV head, an odd vocabulary that stays whole; qwen3_moe: 8 experts,
    4 on each rank, LoRA on them; gpt_oss: 4 heads with their sinks, 2 KV heads, biases,
    sliding windows, 8 biased experts, 4 on each rank; deepseek_v3: multi-head latent
    attention over 4 heads, a dense layer, then grouped routing and a shared expert) and the
    group's results on them."""
    root = tmp_path_factory.mktemp("tp")
    models = {
        "qwen3": str(build_tiny_model(root / "qwen3", arch="qwen3")),
        "qwen2": str(build_tiny_model(root / "qwen2", arch="qwen2", num_heads=4, num_kv_heads=2,
                                      tie_word_embeddings=False)),
        "llama": str(build_tiny_model(root / "llama", arch="llama", num_heads=4, num_kv_heads=1,
                                      vocab_size=1023)),
        "qwen3_moe": str(build_tiny_model(root / "qwen3_moe", arch="qwen3_moe")),
        "gpt_oss": str(build_tiny_model(root / "gpt_oss", arch="gpt_oss", hidden_size=64,
                                        num_heads=4, num_kv_heads=2, intermediate_size=64,
                                        num_experts=8, experts_per_token=4,
                                        tie_word_embeddings=False)),
        "deepseek_v3": str(build_tiny_model(root / "deepseek_v3", arch="deepseek_v3",
                                            num_heads=4)),
        "qwen3_5": str(build_tiny_model(root / "qwen3_5", arch="qwen3_5", num_heads=4,
                                        num_kv_heads=2)),
        "qwen3_next": str(build_tiny_model(root / "qwen3_next", arch="qwen3_next",
                                           num_heads=4, num_kv_heads=2)),
    }
    url = f"tcp://127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, str(HERE / "tp_scenario.py"), json.dumps(
        {"url": url, "rank": r, "world": 2, "tp": 2, "models": models, "out": str(root)})])
        for r in range(2)]
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0]
    return root, models, torch.load(root / "results.pt")


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama", "qwen3_moe", "gpt_oss", "deepseek_v3",
                                  "qwen3_5", "qwen3_next"])
def test_tp2_matches_one_rank(tp_run, arch):
    root, models, results = tp_run
    got, ref = results[arch], run(Engine(models[arch]), None)
    for kind in ("init", "grads_a", "grads_b", "stepped", "grads_top_k", "dimuon"):
        assert got[kind].keys() == ref[kind].keys()
        worst = max(rel_diff(got[kind][k], ref[kind][k]) for k in ref[kind])
        assert worst <= RTOL, (kind, worst, max((rel_diff(got[kind][k], ref[kind][k]), k) for k in ref[kind]))
    assert any(v.abs().max() > 0 for v in ref["grads_a"].values())
    for a, b in zip(got["logprobs"], ref["logprobs"], strict=True):
        assert max(rel_diff(x, y) for x, y in zip(a, b, strict=True)) <= RTOL
    assert rel_diff(got["loss"], ref["loss"]) <= RTOL
    assert rel_diff(got["grad_norm"], ref["grad_norm"]) <= RTOL
    assert max(rel_diff(x, y) for x, y in zip(got["after"], ref["after"], strict=True)) <= RTOL
    assert max(rel_diff(x, y) for x, y in zip(got["top_k"], ref["top_k"], strict=True)) <= RTOL
    assert got["greedy"] == ref["greedy"] and got["seeded"] == ref["seeded"]
    assert rel_diff(got["greedy_lp"], ref["greedy_lp"]) <= RTOL
    assert got["running"] == ref["running"]
    assert rel_diff(got["running_lp"], ref["running_lp"]) <= RTOL




@pytest.mark.parametrize("arch", ["qwen3_5", "gpt_oss", "deepseek_v3"])
def test_tp2_checkpoints_of_the_new_architectures_load_whole(tp_run, arch):
    """Saved from two ranks (Qwen3.5's in_proj_qkv rows gathered back into their three
    blocks, gpt-oss's and DeepSeek's split heads), a checkpoint loads on one rank as the
    weights the split run stepped to (which test_tp2_matches_one_rank holds to one rank's)."""
    root, models, results = tp_run
    eng = Engine(models[arch])
    eng.load("a", root / f"{arch}-ckpt", optimizer=True)
    a = eng.pool.get("a")
    stepped = results[arch]["stepped"]
    for k in a.bank.shapes:
        assert rel_diff(a.bank.A[k][a.slot], stepped[f"A:{k}"]) <= RTOL
        assert rel_diff(a.bank.B[k][a.slot], stepped[f"B:{k}"]) <= RTOL


def test_tp2_checkpoint_loads_whole_and_in_peft(tp_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, models, results = tp_run
    ckpt = root / "qwen3-ckpt"
    eng = Engine(models["qwen3"])
    eng.load("a", ckpt, optimizer=True)
    a = eng.pool.get("a")
    stepped = results["qwen3"]["stepped"]
    for k in a.bank.shapes:
        assert rel_diff(a.bank.A[k][a.slot], stepped[f"A:{k}"]) <= RTOL
        assert rel_diff(a.bank.B[k][a.slot], stepped[f"B:{k}"]) <= RTOL
    assert a.steps == 1
    ids = torch.randint(0, eng.model.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    base = AutoModelForCausalLM.from_pretrained(models["qwen3"], dtype=torch.float32)
    with torch.no_grad():
        theirs = PeftModel.from_pretrained(base, ckpt)(input_ids=ids).logits
        lora = LoraBatch([a, a], eng.model.dtype, eng.model.device)
        pos = torch.arange(11).expand(2, -1)
        ours = eng.model.logits(eng.model.forward(ids, pos, lora), lora)
    assert rel_diff(ours, theirs) <= RTOL


def test_recomputed_activations_give_the_same_gradients(tiny_dir):
    """activation_checkpointing "on" (recompute per layer) changes memory, not results."""
    from tp_scenario import _requests

    out = {}
    for mode in ("off", "on"):
        eng = Engine(tiny_dir, recompute=mode)
        eng.add_adapter("a", LoraConfig(rank=4, seed=1))
        eng.add_adapter("b", LoraConfig(rank=4, seed=2, train_unembed=False))
        res = eng.forward_backward(_requests(eng.model.vocab_size))
        a = eng.pool.get("a")
        out[mode] = ([r.metrics["loss:sum"] for r in res],
                     [g.clone() for g in a.bank.tensors(a.slot, "g")], eng.model.recompute.used)
    assert out["on"][2] > 0 and out["off"][2] == 0
    assert rel_diff(out["on"][0], out["off"][0]) <= 1e-6
    assert max(rel_diff(x, y) for x, y in zip(out["on"][1], out["off"][1], strict=True)) <= 1e-5
