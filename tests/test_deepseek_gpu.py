"""DeepSeek-V3 on a GPU in bf16: packed training rows go through flash attention's varlen
kernel with MLA's key width (nope + rope) and the values padded to it; the padded
sampler's greedy tokens (the latent cache, expanded each step) follow the bf16 model.
Against transformers on the same card (the running batch's latent pages:
tests/test_moe_running_gpu.py). Skips without CUDA.
Run: `pytest -q tests/test_deepseek_gpu.py`."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from twinkled.engine.model import BaseModel
    from twinkled.engine.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("dsg") / "tiny-deepseek_v3",
                            arch="deepseek_v3", num_layers=3, num_heads=4,
                            tie_word_embeddings=False)
    return BaseModel(path, dtype="bfloat16", device="cuda")


def test_packed_bf16_logprobs_follow_transformers(model):
    from twinkled.engine.packed import Packing

    m = model
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, m.vocab_size, (n,), generator=gen).tolist() for n in (64, 9, 33)]
    pk = Packing.of([len(r) for r in rows], m.device)
    ids = torch.tensor([t for r in rows for t in r], device="cuda")
    with torch.no_grad():
        lp = m.logits(m.forward(ids[None], pk.positions, packing=pk))[0].float().log_softmax(-1)
        start = 0
        for r in rows:
            want = m.hf(input_ids=torch.tensor([r], device="cuda")).logits[0].float().log_softmax(-1)
            got = lp[start:start + len(r)]
            # bf16: the same argmax almost everywhere, logprobs close
            assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
            assert (got - want).abs().mean() < 0.05
            start += len(r)


def test_greedy_bf16_runs_on_the_latent_cache(model):
    from twinkled.engine.sampler import generate_padded
    from twinkled.protocol.types import SampleRequest, SamplingParams

    m = model
    prompt = list(range(5, 25))
    req = SampleRequest(None, prompt, SamplingParams(max_tokens=8, temperature=0.0, stop=[]))
    out = generate_padded(m, [req], [None])[0].sequences[0]
    want = m.hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=8,
                         do_sample=False, eos_token_id=None, pad_token_id=0)[0, 20:].tolist()
    assert len(out.tokens) == 8
    assert sum(a == b for a, b in zip(out.tokens, want, strict=True)) >= 6  # bf16 ties
