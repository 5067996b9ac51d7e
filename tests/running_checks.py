"""What every architecture's running batch must give: the padded sampler's samples.

Shared by the per-architecture tests (test_engine_moe.py, test_gpt_oss.py,
test_deepseek.py, test_qwen35_moe.py): an MoE model's running batch (its experts' LoRA per
row, moe.ExpertRows) against `sampler.generate_padded` (LoraBatch), the reference."""

from __future__ import annotations

import torch

from twinkled.engine.running import RunningBatch
from twinkled.engine.sampler import generate, generate_padded
from twinkled.protocol.types import SampleRequest, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, stop=[])
SEEDED = SamplingParams(max_tokens=6, temperature=1.0, seed=3, stop=[])


def mixed_requests(vocab: int, adapters: tuple[str, str] = ("a", "b")) -> list[SampleRequest]:
    """Greedy through one adapter, a seeded fan-out of 2 through the other (a prompt of
    two whole KV pages and more: a prefix the cache can keep), greedy on the base model."""
    gen = torch.Generator().manual_seed(5)
    short, long = (torch.randint(5, vocab, (n,), generator=gen).tolist() for n in (9, 37))
    return [SampleRequest(adapters[0], short, GREEDY),
            SampleRequest(adapters[1], long, SEEDED, num_samples=2),
            SampleRequest(None, long, GREEDY)]


def assert_same_samples(got, want, tol: float = 1e-4) -> None:
    for g, w in zip(got, want, strict=True):
        assert [s.tokens for s in g.sequences] == [s.tokens for s in w.sequences]
        for gs, ws in zip(g.sequences, w.sequences, strict=True):
            assert (torch.tensor(gs.logprobs) - torch.tensor(ws.logprobs)).abs().max() < tol


def assert_running_batch_equals_padded(eng, prefills: tuple[str, ...] = ("padded", "varlen")
                                       ) -> None:
    """Greedy and seeded samples of two adapters (nonzero B, experts included) and the base
    model in one running batch, for each prefill layout (varlen in chunks of 16), equal the
    padded sampler's tokens and logprobs (1e-4); the same requests again hit the prefix
    cache and give the same samples."""
    m = eng.model
    reqs = mixed_requests(m.vocab_size)
    adapters = [None if r.adapter_id is None else eng.pool.get(r.adapter_id) for r in reqs]
    want = generate_padded(m, reqs, adapters)
    assert want[0].sequences[0].logprobs != want[2].sequences[0].logprobs  # adapters count
    for prefill in prefills:
        batch = RunningBatch(m, rows=8, prefill=prefill, prefill_tokens=16, prefix_cache=0.5)
        assert_same_samples(generate(m, reqs, adapters, batch=batch), want)
        again = generate(m, reqs, adapters, batch=batch)
        assert again[1].cached_tokens == 32  # the long prompt's two whole pages
        assert_same_samples(again, want)
