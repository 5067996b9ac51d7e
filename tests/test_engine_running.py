"""Continuous batching over a paged KV cache (engine/running.py): the running batch samples
what the padded sampler samples, rows join and leave at every step, pages come back. Its
prefill (engine/prefill.py, prefill_queue.py): admitted prompts packed end to end in one
varlen pass sample what the padded pass samples; a prompt longer than the step's budget is
prefilled over several steps (chunks), the running rows decoding meanwhile, with the same
results as one pass."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, make_engine, randomize_b

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


def _prompt(eng, n, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(5, eng.model.vocab_size, (n,), generator=gen).tolist()


def _adapters(eng, reqs):
    return [None if r.adapter_id is None else eng.pool.get(r.adapter_id) for r in reqs]


def _assert_same(got, want):
    """Tokens equal; logprobs (sampled, top-k, prompt) equal to float tolerance."""
    for g, w in zip(got, want, strict=True):
        assert [s.tokens for s in g.sequences] == [s.tokens for s in w.sequences]
        assert [s.stop_reason for s in g.sequences] == [s.stop_reason for s in w.sequences]
        for x, y in zip(g.sequences, w.sequences, strict=True):
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)
            assert (x.topk is None) == (y.topk is None)
            if x.topk is not None:
                assert x.topk[0] == y.topk[0]
        if w.prompt_logprobs is not None:
            assert g.prompt_logprobs[1:] == pytest.approx(w.prompt_logprobs[1:], abs=1e-4)


def _mixed(eng):
    """Adapters a, b and the base model; seeded, greedy, top-k/top-p; prompts shorter and
    longer than a page and a whole number of pages (page size 4 below); shared prompts."""
    p, q, r = _prompt(eng, 11, 1), _prompt(eng, 8, 2), _prompt(eng, 3, 3)

    def params(n, **kw):
        return SamplingParams(max_tokens=n, stop=[], **kw)

    return [SampleRequest("a", p, params(9, seed=5), num_samples=3, prompt_logprobs=True),
            SampleRequest("b", p, params(14, temperature=0.7, seed=6, top_p=0.9), num_samples=2),
            SampleRequest("a", p, params(5, temperature=0.0), topk_sample=3),
            SampleRequest(None, q, params(12, seed=7, top_k=5), num_samples=2),
            SampleRequest("b", r, params(3, seed=8)),
            SampleRequest("a", q, params(16, seed=9), num_samples=2)]


@pytest.mark.parametrize("decode", ["eager", "buckets"])
def test_running_batch_samples_what_the_padded_sampler_samples(eng, decode):
    """Same seeds, same tokens: requests of different lengths leave the batch at different
    steps; "buckets" runs the decode at the CUDA graphs' padded sizes (inert slots)."""
    reqs = _mixed(eng)
    ads = _adapters(eng, reqs)
    batch = RunningBatch(eng.model, rows=16, pages=64, page_size=4, decode=decode)
    got = generate(eng.model, reqs, ads, batch=batch)
    _assert_same(got, generate_padded(eng.model, reqs, ads))
    assert batch.idle and batch.free_pages == 63  # every page came back
    if decode == "eager":  # the same batch serves the next call, with the same output
        _assert_same(generate(eng.model, reqs, ads, batch=batch), got)


def test_requests_beyond_the_page_pool_wait_for_pages(eng):
    """12 requests of 2 samples need ~100 pages; the pool has 24: requests wait, join as
    finished rows free their pages, and all sample what the padded sampler samples."""
    reqs = [SampleRequest("ab"[i % 2] if i % 3 else None, _prompt(eng, 5 + i, 40 + i),
                          SamplingParams(max_tokens=6 + i % 4, seed=i, stop=[]), num_samples=2)
            for i in range(12)]
    ads = _adapters(eng, reqs)
    batch = RunningBatch(eng.model, rows=8, pages=25, page_size=4)
    tickets = batch.admit(reqs, ads)
    results, waited, most = {}, 0, 0
    while len(results) < len(reqs):
        for f in batch.step():
            results[f.ticket] = f.result
        waited = max(waited, len(batch.waiting))
        most = max(most, len(batch.live))
        assert batch.free_pages >= 0 and len(batch.live) <= 8
    assert waited > 0 and most > 2  # it did queue, and it did run several at once
    assert batch.free_pages == 24
    _assert_same([results[t] for t in tickets], generate_padded(eng.model, reqs, ads))


def test_a_short_request_beside_a_long_one_finishes_first(eng):
    long = SampleRequest("a", _prompt(eng, 6, 50), SamplingParams(max_tokens=30, seed=1, stop=[]))
    short = SampleRequest("b", _prompt(eng, 9, 51), SamplingParams(max_tokens=3, seed=2, stop=[]))
    batch = RunningBatch(eng.model, rows=4, pages=32, page_size=4)
    t_long, t_short = batch.admit([long, short], _adapters(eng, [long, short]))
    order, steps = [], 0
    while len(order) < 2:
        steps += 1
        order += [(f.ticket, steps) for f in batch.step()]
        if steps == 1:
            assert len(batch.live) == 2  # both admitted at once, decoding side by side
    assert order == [(t_short, 2), (t_long, 29)]  # the first token comes from the prefill
    assert batch.free_pages == 31


def test_a_request_larger_than_the_pool_is_refused_clearly(eng):
    batch = RunningBatch(eng.model, rows=4, pages=8, page_size=4)
    big = SampleRequest("a", _prompt(eng, 10, 60), SamplingParams(max_tokens=40))
    with pytest.raises(ValueError, match="do not fit the sampler's KV pool"):
        batch.admit([big], _adapters(eng, [big]))
    assert batch.idle
    # The engine sizes its own batch to what a call needs.
    assert len(eng.sample([big])[0].sequences[0].tokens) <= 40


def test_trained_weights_are_seen_by_the_next_call(tiny_dir):
    """The running batch keeps adapters' weights while rows use them; a later call after
    the adapter changed samples from the new weights."""
    e = make_engine(tiny_dir)
    e.add_adapter("a", LoraConfig(rank=4, seed=0))
    req = [SampleRequest("a", [5, 6, 7, 8], SamplingParams(max_tokens=8, temperature=0, stop=[]))]
    before = e.sample(req)[0].sequences[0].tokens
    randomize_b(e, "a", seed=3, std=0.5)
    after = e.sample(req)[0].sequences[0].tokens
    want = generate_padded(e.model, req, _adapters(e, req))[0].sequences[0].tokens
    assert after == want and after != before


def test_decode_slices_stream_and_let_a_later_short_request_pass(tiny_dir):
    """Engine.sample_submit / sample_slice: a long request runs in bounded slices; a short
    one submitted later joins at a slice boundary and finishes first; a blocking `sample`
    in between runs beside them; streamed pieces add up to the final tokens."""
    e = make_engine(tiny_dir)
    e.add_adapter("a", LoraConfig(rank=4, seed=0))
    randomize_b(e, "a", seed=4, std=0.3)
    greedy = SamplingParams(max_tokens=24, temperature=0, stop=[])
    long = SampleRequest("a", [5, 6, 7, 8, 9], greedy, num_samples=2)
    short = SampleRequest(None, [9, 8, 7], SamplingParams(max_tokens=3, seed=1, stop=[]))
    (t_long,) = e.sample_submit([long])
    assert e.sample_slice(max_steps=4) == []
    streamed = [list(p) for p in e.sample_pieces()[t_long]]
    assert all(len(p) == 5 for p in streamed)  # the prefill's token and 4 decode steps
    (t_short,) = e.sample_submit([short])
    finished = e.sample_slice(max_steps=3)
    assert [f.ticket for f in finished] == [t_short]
    mid = e.sample([short])  # blocking, beside the running long request
    finished = []
    while len(finished) < 1:
        for piece, more in zip(streamed, e.sample_pieces().get(t_long, [[], []]), strict=True):
            piece += more
        finished += e.sample_slice(max_steps=5)
    (done,) = finished
    assert done.ticket == t_long
    want = generate_padded(e.model, [long, short], _adapters(e, [long, short]))
    _assert_same([done.result], want[:1])
    _assert_same(mid, want[1:])
    for piece, seq in zip(streamed, done.result.sequences, strict=True):
        assert seq.tokens[:len(piece)] == piece  # the rest came with the result
    assert e.sample_slice() == []


def test_the_sampler_page_pool_is_sized_by_kv_bytes(tiny_dir):
    """Config `sample_kv_mb` reaches the engine as `kv_bytes`: the pool it makes is that
    size (the tiny model's KV is 1 KiB a position at most here), not the device default."""
    small, default = make_engine(tiny_dir, kv_bytes=1 << 20), make_engine(tiny_dir)
    req = SampleRequest(None, _prompt(small, 6, 70), SamplingParams(max_tokens=4))
    for e in (small, default):
        assert e.kv_pages == 0
        assert len(e.sample([req])[0].sequences[0].tokens) == 4
    assert 0 < small.kv_pages < default.kv_pages



def test_config_sample_rows_bounds_the_rows_decoding_at_once(tiny_dir):
    """Config `sample_rows` reaches the engine: with 2 rows, the second of two 2-sample
    requests waits for the first to finish; with the default both decode at once."""
    reqs = [SampleRequest(None, [5 + i] * 6, SamplingParams(max_tokens=3, seed=i),
                          num_samples=2) for i in range(2)]
    waiting = []
    for e in (make_engine(tiny_dir, sample_rows=2), make_engine(tiny_dir)):
        e.sample_submit(reqs)
        e.sample_slice(max_steps=1)
        waiting.append(e.sample_waiting)
        while not e.sample_idle:
            e.sample_slice()
    assert waiting == [1, 0]


def test_a_cancelled_request_leaves_at_once_and_gives_its_pages_back(eng):
    """RunningBatch.cancel: a running request's rows leave the batch, every page comes
    back, and the request beside it samples what it would alone; a queued one is simply
    dropped, a finished one cannot be."""
    greedy = SamplingParams(max_tokens=40, temperature=0, stop=[])
    stay = SampleRequest("a", _prompt(eng, 21, 5), greedy, num_samples=2)
    gone = SampleRequest("b", _prompt(eng, 37, 6), greedy, num_samples=3)
    batch = RunningBatch(eng.model)
    free = batch.free_pages
    t_stay, t_gone = batch.admit([stay, gone], _adapters(eng, [stay, gone]))
    assert batch.run(max_steps=3) == []
    assert batch.cancel(t_gone) and not batch.cancel(t_gone)
    assert set(batch.partials()) == {t_stay}
    (queued,) = batch.admit([gone], _adapters(eng, [gone]))
    assert batch.waiting_requests == 1 and batch.cancel(queued)
    finished = batch.run()
    assert [f.ticket for f in finished] == [t_stay] and not batch.cancel(t_stay)
    assert batch.idle and batch.free_pages == free
    _assert_same([finished[0].result], generate_padded(eng.model, [stay], _adapters(eng, [stay])))


def test_a_slice_ends_after_a_finish_only_once_min_seconds_passed(eng):
    """`until_done` ends a slice at the first finished request; with `min_seconds` it
    decodes on until that time has passed (fewer round trips for a rollout)."""
    def two():
        long = SampleRequest("a", _prompt(eng, 6, 50), SamplingParams(max_tokens=30, seed=1,
                                                                      stop=[]))
        short = SampleRequest("b", _prompt(eng, 9, 51), SamplingParams(max_tokens=3, seed=2,
                                                                       stop=[]))
        batch = RunningBatch(eng.model, rows=4, pages=32, page_size=4)
        return batch, batch.admit([long, short], _adapters(eng, [long, short]))

    batch, (t_long, t_short) = two()
    assert [f.ticket for f in batch.run(until_done=True)] == [t_short]
    batch, (t_long, t_short) = two()
    done = batch.run(until_done=True, min_seconds=600.0)  # on until the batch is idle
    assert [f.ticket for f in done] == [t_short, t_long] and batch.idle


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
    7 steps; the results are those of one pass (from cached prefixes too). Varlen prefill
    named: a card's default, padded, does not cut a prompt."""
    reqs = _requests(eng)
    batch = RunningBatch(eng.model, rows=16, pages=128, page_size=4, prefill_tokens=7,
                         prefill="varlen")
    (*_, t_long) = batch.admit(reqs, _adapters(eng, reqs))
    batch.step()  # every request admitted at once; the long prompt waits for its chunks
    assert batch.waiting_requests == 0 and batch.partials([t_long])[t_long][0].tokens == []
    whole = _run_twice(eng, reqs, prefill_tokens=4096, prefill="varlen")
    chunked = _run_twice(eng, reqs, prefill_tokens=7, prefill="varlen")
    for got, want in zip(chunked, whole, strict=True):
        _assert_same(got, want)


def test_a_running_row_keeps_decoding_while_a_long_prompt_is_chunk_prefilled(eng):
    """A 60-token prompt at 16 tokens a step takes 4 steps to prefill; the running row
    gets a token at each of them, and the long request's first token comes at the 4th.
    A request cancelled while its prompt prefills gives every page back. (Varlen prefill and
    no overlap named: a card's defaults, padded and launching a step before the last lands,
    count steps otherwise.)"""
    greedy = SamplingParams(max_tokens=30, temperature=0, stop=[])
    short = SampleRequest("a", _prompt(eng, 5, 8), greedy)
    long = SampleRequest(None, _prompt(eng, 60, 9), SamplingParams(max_tokens=4, seed=2, stop=[]))
    gone = SampleRequest("b", _prompt(eng, 50, 10), greedy)
    batch = RunningBatch(eng.model, rows=4, pages=64, page_size=4, prefill_tokens=16,
                         prefill="varlen", overlap=False)
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


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs: a GPU")
def test_graphs_are_recaptured_after_the_adapter_stack_grows(tiny_dir):
    """Adapters arriving while the batch samples grow the stack (and its rank block), which
    drops the captured graphs: their recapture must work (on 2026-11-29 it failed in the
    daemon: the allocator's pool use_count assert, every tenant's sample failed) and sample
    what eager decoding samples."""
    e = make_engine(tiny_dir)
    names = [f"g{i}" for i in range(6)]
    for i, name in enumerate(names):  # rank 4 first, then rank 32s that widen the stack
        e.add_adapter(name, LoraConfig(rank=4 if i == 0 else 32, alpha=16, seed=i))
        randomize_b(e, name, seed=40 + i, std=0.3)
    params = SamplingParams(max_tokens=6, stop=[], seed=3)
    reqs = [SampleRequest(n, _prompt(e, 5 + i, i), params, num_samples=2)
            for i, n in enumerate(names)]
    ads = _adapters(e, reqs)
    graphs = RunningBatch(e.model, rows=16, pages=64, page_size=4, decode="graphs")
    eager = RunningBatch(e.model, rows=16, pages=64, page_size=4, decode="eager")
    for k in range(1, len(reqs) + 1):  # each call brings one more adapter into the stack
        _assert_same(generate(e.model, reqs[:k], ads[:k], batch=graphs),
                     generate(e.model, reqs[:k], ads[:k], batch=eager))
