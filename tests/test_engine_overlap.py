"""The overlapped decode loop (engine/decode_loop.py) samples what the synchronous one
samples: each step is launched before the host records the previous one, so the rows that
stopped ran one step too many and their requests' seeded draws are redone."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, one_adapter_engine

from twinkled.engine.running import RunningBatch
from twinkled.protocol.types import SampleRequest, SamplingParams


@pytest.fixture(scope="module")
def eng(tiny_dir):
    return one_adapter_engine(tiny_dir)


def _prompt(eng, n, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(5, eng.model.vocab_size, (n,), generator=gen).tolist()


def _requests(eng) -> list[SampleRequest]:
    """Seeded requests of several samples that stop on a token class (1 in 8 ids: their
    samples stop at different steps), greedy, top-k/top-p, EOS-only, max_tokens only, a
    request to cancel and an unseeded one (not compared: its draws are the global stream's)."""
    ids = torch.randperm(eng.model.vocab_size, generator=torch.Generator().manual_seed(9))
    stops = ids[: eng.model.vocab_size // 8].tolist()

    def params(n, stop=stops, **kw):
        return SamplingParams(max_tokens=n, stop=stop, **kw)

    return [SampleRequest("a", _prompt(eng, 7, 1), params(14, seed=1), num_samples=3,
                          topk_sample=2),
            SampleRequest(None, _prompt(eng, 5, 2), params(30, stop=[], seed=2)),  # cancelled
            SampleRequest("a", _prompt(eng, 9, 3), params(8, temperature=0.0)),
            SampleRequest("a", _prompt(eng, 4, 4), params(12, seed=4), num_samples=4),
            SampleRequest(None, _prompt(eng, 6, 5), params(10, stop=None, seed=5, top_p=0.8),
                          num_samples=2),
            SampleRequest("a", _prompt(eng, 3, 6), params(9, seed=6, top_k=7), num_samples=2),
            SampleRequest(None, _prompt(eng, 8, 7), params(6, stop=[])),  # unseeded
            SampleRequest("a", _prompt(eng, 7, 1), params(11, temperature=0.5, seed=8),
                          num_samples=3)]


def _drive(eng, overlap: bool, decode: str, chunk: int | None) -> tuple[list[int], dict]:
    """Three requests start; the rest join at step 2 and wait for rows (6) as others
    finish; request 1 is cancelled at step 4. Every page comes back. `chunk`: prompt
    tokens a step prefills (5: prompts cut into chunks, rows joining mid-flight)."""
    reqs = _requests(eng)
    ads = [None if r.adapter_id is None else eng.pool.get(r.adapter_id) for r in reqs]
    batch = RunningBatch(eng.model, rows=6, pages=48, page_size=4, decode=decode,
                         overlap=overlap, prefill_tokens=chunk)
    assert batch.overlap is overlap
    free = batch.free_pages
    tickets = batch.admit(reqs[:3], ads[:3])
    results, steps = {}, 0
    while steps < 3 or not batch.idle:
        if steps == 2:
            tickets += batch.admit(reqs[3:], ads[3:])
        if steps == 4:
            assert batch.cancel(tickets[1])
        results.update((f.ticket, f.result) for f in batch.step())
        steps += 1
        if steps == 1 and chunk is None:  # a step is in flight while the host returns
            assert batch.loop.in_flight is overlap  # (none while prompts still prefill)
    assert batch.free_pages == free  # no page leaked, none freed twice
    assert not batch.loop.in_flight
    return tickets, results


@pytest.mark.parametrize("decode,chunk", [("eager", None), ("buckets", None), ("eager", 5)] + (
    [("graphs", None)] if DEVICE == "cuda" else []))
def test_overlapped_and_synchronous_loops_sample_the_same(eng, decode, chunk):
    t_sync, sync = _drive(eng, False, decode, chunk)
    t_over, over = _drive(eng, True, decode, chunk)
    cancelled, unseeded = 1, 6
    assert t_sync[cancelled] not in sync and t_over[cancelled] not in over
    assert len(over[t_over[unseeded]].sequences[0].tokens) == 6
    split = 0
    for i, (a, b) in enumerate(zip(t_sync, t_over, strict=True)):
        if i in (cancelled, unseeded):
            continue
        want, got = sync[a].sequences, over[b].sequences
        assert [s.tokens for s in got] == [s.tokens for s in want], i
        assert [s.stop_reason for s in got] == [s.stop_reason for s in want], i
        for x, y in zip(got, want, strict=True):
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
            assert (x.topk is None) == (y.topk is None)
            if x.topk is not None:
                assert x.topk[0] == y.topk[0]
                assert sum(x.topk[1], []) == pytest.approx(sum(y.topk[1], []), abs=1e-5)
        lengths = {len(s.tokens) for s in want}
        if want[0].stop_reason and len(want) > 1 and len(lengths) > 1 and "stop" in {
                s.stop_reason for s in want}:
            split += 1  # a sample stopped on a token while its siblings went on
    # The case the redo is for happened: seeded siblings that stopped at different steps.
    assert split >= 2


def test_requests_that_can_join_next_step_find_no_step_launched_ahead(eng):
    """Prompts admitted a few at a time (the prefill budget): while the next ones can join,
    no step runs ahead, so every step's batch is the synchronous loop's."""
    reqs = [SampleRequest(None, _prompt(eng, 6, 20 + i), SamplingParams(
        max_tokens=5 + i, stop=[], seed=i)) for i in range(5)]
    got = {}
    for overlap in (False, True):
        batch = RunningBatch(eng.model, rows=8, pages=40, page_size=4, prefill_tokens=12,
                             overlap=overlap)
        tickets, out, ahead = batch.admit(reqs, [None] * 5), {}, []
        while not batch.idle:
            out.update((f.ticket, f.result) for f in batch.step())
            ahead.append(batch.loop.in_flight)
        got[overlap] = [[s.tokens for s in out[t].sequences] for t in tickets]
        if overlap:  # two prompts a step join over the first steps; then it runs ahead
            assert ahead[:2] == [False, False] and ahead[2] is True
    assert got[True] == got[False]


def test_cancelling_the_last_rows_leaves_nothing_in_flight(eng):
    req = SampleRequest(None, _prompt(eng, 5, 30), SamplingParams(max_tokens=20, stop=[]))
    batch = RunningBatch(eng.model, rows=4, pages=16, page_size=4, overlap=True)
    (ticket,) = batch.admit([req], [None])
    batch.step()
    batch.step()
    assert batch.loop.in_flight
    assert batch.cancel(ticket)
    assert batch.idle and not batch.loop.in_flight and batch.free_pages == 15
