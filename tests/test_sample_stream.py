"""Service.sample_stream (twinkled/core/streams.py), in-process: pieces of the queued sample op,
and a stream cancelled before its sample runs is taken out of the queue."""

from __future__ import annotations

import pytest
from test_service import done, run, service

from twinkled.protocol.errors import UserError
from twinkled.protocol.frames import SampleF, SamplingF, buf


def frame(prompt: list[int], max_tokens: int, n: int, seed: int) -> SampleF:
    return SampleF(None, buf(prompt, "int64"), SamplingF(max_tokens, 1.0, -1, 1.0, seed, None), n)


def test_a_stream_yields_its_choices_and_a_cancelled_one_leaves_the_queue(tiny_dir, tmp_path):
    async def go():
        async with service(tiny_dir, tmp_path) as box:
            box.store.tenants.ensure("ann")
            svc = box.svc
            # Queued together, before the engine loop runs: the cancelled one never runs.
            kept = svc.sample_stream("ann", "base", frame([3, 1, 4], 5, 2, seed=1))
            gone = svc.sample_stream("ann", "base", frame([2, 7], 500, 4, seed=2))
            assert gone.cancel()
            assert svc.lanes.all[0].planner.status()["ann"]["queued_requests"] == 1
            pieces = [p async for p in kept]
            with pytest.raises(UserError, match="client went away"):
                async for _ in gone:
                    pass
            # Resolved: too late to take out.
            assert not kept.cancel()
            # The same op through the plain sample command gives the same tokens.
            same = svc.sample("ann", {"id": "base"}, frame([3, 1, 4], 5, 2, seed=1), box.keep)
            await done(same)
            return pieces, same, svc.lanes.all[0].planner.status()["ann"]["queued_requests"]

    pieces, same, queued = run(go())
    import pickle

    want = pickle.loads(same.payload).sequences
    assert [p.choice for p in pieces] == [0, 1]
    assert [p.tokens for p in pieces] == [s.tokens for s in want]
    assert all(p.finish in ("stop", "length") and len(p.logprobs) == len(p.tokens)
               for p in pieces)
    assert queued == 0
