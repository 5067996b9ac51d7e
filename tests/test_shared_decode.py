"""The torch cascade (engine/shared_decode.py: a fan-out's shared prompt pages read once a
step on CPU) against the gather + SDPA it replaces, alone and in the running batch."""

from __future__ import annotations

import pytest
import torch
from helpers import one_adapter_engine
from test_engine_kernels import _GROUPED, _GROUPS, _LENGTHS, _SHARED, _case, _reference

from twinkled.engine import shared_decode
from twinkled.engine.kv_pages import PagePool
from twinkled.engine.running import RunningBatch
from twinkled.engine.sampler import generate
from twinkled.protocol.types import SampleRequest, SamplingParams


@pytest.mark.parametrize("heads,kv", [(4, 2), (3, 1), (2, 2)])
def test_shared_prefix_attention_matches_gather_and_sdpa(heads, kv):
    """fp32, to 1e-5: groups of 8 and 3 rows, a lone row, the two rows left of a group
    that are no longer adjacent slots (row 13 moved in between), rows sharing nothing and an
    inert slot; GQA of 2 and 3 query heads a kv head, and none."""
    pool, q, k, v, table, lens = _case(heads, kv, 16, 4, _GROUPED, _LENGTHS, pages=36, seed=2)
    want = _reference(pool, 1, q, k, v, table, lens, 0.3)
    rows = shared_decode.plan(_GROUPS, _SHARED, 4, q.device)
    assert [(len(range(16)[i]) if isinstance(i, slice) else i.tolist(), pages)
            for i, _, pages in rows.groups] == [(8, 3), (3, 2), ([12, 14], 2)]
    got = shared_decode.attend(q, pool.k[1], pool.v[1], rows.at(table, lens - 1, 4), 4, 0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_no_plan_where_no_two_rows_share():
    """A lone sample (shared 0) and a group's last row left: the gather serves them."""
    assert shared_decode.plan([1, 2, 3], [0, 8, 0], 4, torch.device("cpu")) is None


@pytest.mark.parametrize("layers,dst", [(2, [5, 7, 2]), (1, [5])])
def test_copy_page_fans_a_prompt_page_out(layers, dst):
    """A prompt's partial page into its samples' pages, every layer's keys and values, in
    one copy; other pages untouched. One layer, one destination: the source is then a
    contiguous piece of the pool (index_copy_ refuses it uncloned; Qwen3.5's pool). A
    latent pool's zero-wide values too."""
    for latent in (False, True):
        pool = PagePool(layers, 1, 8, 10, 4, torch.float32, torch.device("cpu"),
                        v_dim=0 if latent else None, latent=latent)
        pool.k.normal_(), pool.v.normal_()
        want = [t.clone() for t in (pool.k, pool.v)]
        for t in want:
            for d in dst:
                t[:, d * 4:d * 4 + 4] = t[:, 12:16]
        pool.copy_page(3, dst)
        assert torch.equal(pool.k, want[0]) and torch.equal(pool.v, want[1])


@pytest.fixture(scope="module")
def eng(tiny_dir):
    return one_adapter_engine(tiny_dir)


def test_running_batch_samples_what_the_gather_samples(eng, monkeypatch):
    """RunningBatch with the torch cascade on and off (CPU, fp32, eager): the same tokens
    for seeded fan-outs and a greedy row beside them, logprobs within 1e-5, while rows stop
    on a class of stop ids at different steps (groups shrink, rows move slots); the cascade
    ran. On by default on CPU in fp32."""
    calls = []
    real = shared_decode.attend
    monkeypatch.setattr(shared_decode, "attend", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(3)
    vocab = eng.model.vocab_size
    p, q, r = (torch.randint(5, vocab, (n,), generator=gen).tolist() for n in (21, 9, 13))
    stops = list(range(5, vocab, 9))  # ~11% of the ids: rows stop at different steps
    reqs = [SampleRequest("a", p, SamplingParams(max_tokens=12, stop=stops, seed=4),
                          num_samples=5),
            SampleRequest(None, q, SamplingParams(max_tokens=7, temperature=0.0, stop=[])),
            SampleRequest("a", r, SamplingParams(max_tokens=9, temperature=0.7, seed=8,
                                                 stop=stops), num_samples=3)]
    ads = [None if x.adapter_id is None else eng.pool.get(x.adapter_id) for x in reqs]
    out = {}
    for cascade in (False, True):
        batch = RunningBatch(eng.model, rows=16, pages=64, page_size=4, decode="eager",
                             cascade=cascade)
        out[cascade] = generate(eng.model, reqs, ads, batch=batch)
        assert bool(calls) is cascade
    lengths = {len(s.tokens) for s in out[True][0].sequences}
    assert len(lengths) > 1  # the fan-out's rows stopped at different steps
    for ref, got in zip(out[False], out[True], strict=True):
        for x, y in zip(ref.sequences, got.sequences, strict=True):
            assert x.tokens == y.tokens
            assert y.logprobs == pytest.approx(x.logprobs, abs=1e-5)
    assert RunningBatch(eng.model, rows=2, pages=8, page_size=4).decode.cascade
    with pytest.raises(ValueError, match="paged kernel"):
        RunningBatch(eng.model, rows=2, pages=8, page_size=4, decode="graphs", cascade=True)
