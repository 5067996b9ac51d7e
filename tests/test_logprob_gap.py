"""The sampler's logprobs against the trainer's on bf16 (issue 31, item 4): where the two
paths round alike, so do their logprobs (docs/reference.md "Sampler vs trainer logprobs")."""

from __future__ import annotations

import pytest
import torch
from helpers import randomize_b

from twinkled.engine.engine import Engine
from twinkled.engine.kernels import runnable
from twinkled.engine.lora import LoraBatch
from twinkled.engine.lora_rows import AdapterStack, row_lora
from twinkled.engine.tiny import build_tiny_model
from twinkled.protocol.types import LoraConfig, SampleRequest, SamplingParams


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    """A model deep and wide enough for bf16 rounding to show (4 layers of 256), in bf16,
    with two adapters on attention and MLP."""
    path = build_tiny_model(tmp_path_factory.mktemp("gap") / "m", hidden_size=256,
                            num_layers=4, num_heads=4, intermediate_size=768, embed_std=0.06)
    eng = Engine(path, dtype="bfloat16")
    for i, name in enumerate("ab"):
        eng.add_adapter(name, LoraConfig(rank=8, alpha=16, seed=i, train_unembed=False))
        randomize_b(eng, name, seed=30 + i, std=0.05)
    return eng


def test_row_lora_adds_the_delta_as_the_trainer_does(bf16):
    """The sampler's masked LoRA rows give the trainer's LoraBatch result bit for bit in
    bf16: both add an adapter's delta by one matmul-add (rounding the delta first, then
    adding, differed)."""
    a = bf16.pool.get("a")
    stack = AdapterStack(torch.bfloat16, bf16.model.device)
    stack.acquire(a)
    key = "model.layers.1.mlp.up_proj"
    fin, fout = bf16.model.targets[key]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((3, 5, fin), generator=gen).bfloat16()
    y = torch.randn((3, 5, fout), generator=gen).bfloat16()
    with torch.no_grad():
        want = LoraBatch([a] * 3, torch.bfloat16, bf16.model.device).apply(key, x, y.clone())
        got = row_lora(stack, [a] * 3, kernels=False).apply(key, x, y.clone())
    assert torch.equal(got, want)


def test_the_bf16_gap_between_sampler_and_trainer_is_small(bf16):
    """Samples of the running batch at temperature 1, scored again by the training forward
    (Engine.logprob_gap, the daemon's running figure): on CPU the two differ only where a
    GEMM's rows come in another shape (decode, prefill, the trainer's pass). The sampler and
    the trainer rounding an adapter's delta differently put the mean at 0.0075 nats here."""
    gen = torch.Generator().manual_seed(1)
    vocab = bf16.model.vocab_size
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=2, stop=[])
    reqs = [SampleRequest(name, torch.randint(5, vocab, (24,), generator=gen).tolist(),
                          params, num_samples=4) for name in "abab"]
    gaps = [bf16.logprob_gap(req.adapter_id, req.prompt, s.tokens, s.logprobs)
            for req, res in zip(reqs, bf16.sample(reqs), strict=True) for s in res.sequences]
    tokens = sum(g.tokens for g in gaps)
    mean = sum(g.mean * g.tokens for g in gaps) / tokens
    assert tokens == 16 * 24
    assert mean < 0.0045, mean


@pytest.mark.skipif(not runnable(torch.device("cpu")), reason="needs triton and TRITON_INTERPRET=1")
def test_the_lora_row_kernel_rounds_y_plus_delta_once():
    """The Triton expand (what the sampler runs on CUDA) rounds y + delta once, as RowLora's
    and the trainer's matmul-adds do: fp16 in the interpreter (its bf16 dot is not exact),
    against that rounding done by hand. Rounding the delta first differs by an ulp."""
    from twinkled.engine.kernels import lora_decode

    gen = torch.Generator().manual_seed(3)
    n, fin, fout, width = 8, 256, 256, 64
    x = torch.randn((n, fin), generator=gen).half()
    a = (torch.randn((width, fin), generator=gen) * 0.05).half()
    b = (torch.randn((fout, width), generator=gen) * 0.05).half()
    y0 = torch.randn((n, fout), generator=gen).half()
    start = torch.tensor([0, 16, 32, 48] * 2, dtype=torch.int32)
    rank = torch.full((n,), 16, dtype=torch.int32)
    y = y0.clone()
    lora_decode.apply(lora_decode.plan(start, rank, torch.ones(n)), x, a, b, y, 16)
    mask = torch.zeros((n, width))
    for i in range(n):
        mask[i, start[i]:start[i] + 16] = 1
    h = (x.float() @ a.float().t()).half().float() * mask
    delta = h @ b.float().t()
    assert torch.equal(y, (y0.float() + delta).half())
    assert not torch.equal(y, (y0.float() + delta.half().float()).half())
