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


def test_a_stream_read_whole_is_fed_nothing_before_its_end_and_slices_run_long(tiny_dir,
                                                                               tmp_path):
    """`live=False` (an OpenAI answer read whole): the op carries no feed, so the workers'
    slice may run long (PendingSamples.step: slice_max_s); its pieces, all at the end,
    are a live stream's. A live stream's op keeps slices short (its reader gets tokens as
    each ends)."""
    async def go():
        async with service(tiny_dir, tmp_path, sample_slice_ms=20,
                           sample_long_slice_ms=5000) as box:
            box.store.tenants.ensure("ann")
            svc, core = box.svc, box.svc.lanes.all[0].core
            sent = []
            step = core.samples.step

            def spy(ops, alone=False):
                frame = step(ops, alone)
                sent.append((frame.kind, frame.slice_max_s))
                return frame
            core.samples.step = spy
            whole = svc.sample_stream("ann", "base", frame([3, 1, 4], 40, 2, seed=1), live=False)
            got_whole = [p async for p in whole]
            kinds_whole, sent[:] = list(sent), []
            live = svc.sample_stream("ann", "base", frame([3, 1, 4], 40, 2, seed=1))
            got_live = [p async for p in live]
            return got_whole, kinds_whole, got_live, list(sent)

    got_whole, sent_whole, got_live, sent_live = run(go())
    def joined(pieces):
        out = {}
        for p in pieces:
            tokens, _ = out.get(p.choice, ([], None))
            out[p.choice] = (tokens + list(p.tokens), p.finish)
        return out

    assert len(got_whole) == 2 < len(got_live)  # (one piece a choice, against many)
    assert joined(got_whole) == joined(got_live)
    assert all(len(tokens) == 40 for tokens, _ in joined(got_whole).values())
    assert sent_whole and all(longest == 5.0 for _, longest in sent_whole)
    assert sent_live and all(longest == 0.0 for _, longest in sent_live)
