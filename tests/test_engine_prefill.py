"""The running batch's prefill (engine/prefill.py, prefill_queue.py): admitted prompts packed
end to end in one varlen pass sample what the padded pass samples; a prompt longer than the
step's budget is prefilled over several steps (chunks), the running rows decoding meanwhile,
with the same results as one pass."""

from __future__ import annotations

import pytest
from helpers import make_engine, randomize_b
from test_engine_running import _adapters, _assert_same, _mixed, _prompt

from twinkled.engine.running import RunningBatch
from twinkled.engine.sampler import generate, generate_padded
from twinkled.protocol.types import LoraConfig, SampleRequest, SamplingParams


@pytest.fixture(scope="module")
def eng(tiny_dir):
    e = make_engine(tiny_dir)
    e.add_adapter("a", LoraConfig(rank=4, alpha=16, seed=0))
    e.add_adapter("b", LoraConfig(rank=2, alpha=8, seed=1, train_unembed=False))
    for i, name in enumerate("ab"):
        randomize_b(e, name, seed=20 + i, std=0.3)
    return e


def _requests(eng):
    """_mixed's requests (3 adapters, shared prompts, prompt logprobs, top-k) and a long
    prompt with its scores asked, of several chunks below."""
    long = SampleRequest("b", _prompt(eng, 45, 4), SamplingParams(max_tokens=6, seed=3, stop=[]),
                         num_samples=2, prompt_logprobs=True)
    return [*_mixed(eng), long]


def _run_twice(eng, reqs, **kw):
    """Both calls' results on one batch with the prefix cache on: the second call's prompts
    start from their cached pages (a piece with keys before its start)."""
    batch = RunningBatch(eng.model, rows=16, pages=128, page_size=4, prefix_cache=0.5, **kw)
    ads = _adapters(eng, reqs)
    first = generate(eng.model, reqs, ads, batch=batch)
    second = generate(eng.model, reqs, ads, batch=batch)
    assert batch.idle and batch.cache.stats.cached_tokens > 0
    return first, second


def test_varlen_prefill_samples_what_the_padded_prefill_samples(eng):
    """fp32: same seeds, same tokens; sampled and prompt logprobs to 1e-4, on a cold batch
    and from cached prefixes."""
    reqs = _requests(eng)
    padded = _run_twice(eng, reqs, prefill="padded")
    varlen = _run_twice(eng, reqs, prefill="varlen")
    for got, want in zip(varlen, padded, strict=True):
        _assert_same(got, want)
    _assert_same(varlen[0], generate_padded(eng.model, reqs, _adapters(eng, reqs)))


def test_chunked_prefill_samples_what_an_unchunked_prefill_samples(eng):
    """A budget of 7 tokens a step cuts prompts mid-page and spreads the long one over
    7 steps; the results are those of one pass (from cached prefixes too)."""
    reqs = _requests(eng)
    batch = RunningBatch(eng.model, rows=16, pages=128, page_size=4, prefill_tokens=7)
    (*_, t_long) = batch.admit(reqs, _adapters(eng, reqs))
    batch.step()  # every request admitted at once; the long prompt waits for its chunks
    assert batch.waiting_requests == 0 and batch.partials([t_long])[t_long][0].tokens == []
    whole = _run_twice(eng, reqs, prefill_tokens=4096)
    chunked = _run_twice(eng, reqs, prefill_tokens=7)
    for got, want in zip(chunked, whole, strict=True):
        _assert_same(got, want)


def test_a_running_row_keeps_decoding_while_a_long_prompt_is_chunk_prefilled(eng):
    """A 60-token prompt at 16 tokens a step takes 4 steps to prefill; the running row
    gets a token at each of them, and the long request's first token comes at the 4th.
    A request cancelled while its prompt prefills gives every page back."""
    greedy = SamplingParams(max_tokens=30, temperature=0, stop=[])
    short = SampleRequest("a", _prompt(eng, 5, 8), greedy)
    long = SampleRequest(None, _prompt(eng, 60, 9), SamplingParams(max_tokens=4, seed=2, stop=[]))
    gone = SampleRequest("b", _prompt(eng, 50, 10), greedy)
    batch = RunningBatch(eng.model, rows=4, pages=64, page_size=4, prefill_tokens=16)
    free = batch.free_pages
    (t_short,) = batch.admit([short], _adapters(eng, [short]))
    batch.step()
    t_long, t_gone = batch.admit([long, gone], _adapters(eng, [long, gone]))
    grew = []
    for _ in range(3):
        before = len(batch.live[0].tokens)
        batch.step()
        grew.append(len(batch.live[0].tokens) - before)
        assert batch.partials([t_long])[t_long][0].tokens == []  # still prefilling
    assert grew == [1, 1, 1]
    assert batch.cancel(t_gone)
    batch.step()  # the long prompt's last chunk: its samples join
    assert len(batch.partials([t_long])[t_long][0].tokens) == 2  # its first token, one step
    results = {f.ticket: f.result for f in batch.run()}
    assert set(results) == {t_short, t_long} and batch.idle and batch.free_pages == free
    want = generate_padded(eng.model, [short, long], _adapters(eng, [short, long]))
    _assert_same([results[t_short], results[t_long]], want)
