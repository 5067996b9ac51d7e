"""MoE models' running batch on a GPU (issue 34): Qwen3-MoE, gpt-oss (sinks, windows) and
DeepSeek-V3 (the latent in the KV pages) with two adapters whose experts carry LoRA, as
`Engine.sample` runs it there (padded prefill, the Triton LoRA kernels, the overlapped
loop, eager decode steps) and with the varlen prefill and a prefix-cache hit, against the
padded sampler on the same card. fp32: the same tokens, logprobs within 2e-3 (TF32 off);
bf16: it runs. Skips without CUDA.

    pytest -q tests/test_moe_running_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from helpers import two_adapter_engine
from running_checks import assert_same_samples, mixed_requests

from twinkled.engine.running import RunningBatch
from twinkled.engine.sampler import generate, generate_padded

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHAPES = {"qwen3_moe": {}, "deepseek_v3": {"num_layers": 3, "num_heads": 4},
          "gpt_oss": {"num_layers": 4, "hidden_size": 128, "num_heads": 4, "num_kv_heads": 2,
                      "intermediate_size": 128, "num_experts": 8, "experts_per_token": 4}}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def arch_dir(request, tmp_path_factory):
    from twinkled.engine.tiny import build_tiny_model

    arch = request.param
    return build_tiny_model(tmp_path_factory.mktemp("moeg") / f"tiny-{arch}", arch=arch,
                            tie_word_embeddings=False, **SHAPES[arch])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_running_batch_on_cuda_samples_as_the_padded_sampler(arch_dir, dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    eng = two_adapter_engine(arch_dir, device="cuda", dtype=dtype)
    assert not eng.padded_sampling
    m = eng.model
    reqs = mixed_requests(m.vocab_size)
    adapters = [None if r.adapter_id is None else eng.pool.get(r.adapter_id) for r in reqs]
    want = generate_padded(m, reqs, adapters)
    runs = [eng.sample(reqs)]  # the engine's own batch: padded prefill, kernels, overlap
    batch = RunningBatch(m, rows=8, prefill="varlen", prefill_tokens=16, prefix_cache=0.5)
    runs += [generate(m, reqs, adapters, batch=batch) for _ in range(2)]
    assert runs[2][1].cached_tokens == 32
    for got in runs:
        if dtype == "float32":
            assert_same_samples(got, want, tol=2e-3)
        else:  # bf16 rounds apart on the two paths (a tiny random model's ties flip)
            for res in got:
                for s in res.sequences:
                    assert len(s.tokens) == 6 and all(abs(x) < 1e4 for x in s.logprobs)
