"""The Triton kernels (engine/kernels/) against the torch paths they replace, run by Triton's
interpreter on CPU (conftest sets TRITON_INTERPRET=1): the paged decode attention against
the gather + SDPA of kv_pages.PagedView, and the running batch with and without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same_samples, one_adapter_engine

from twinkled.engine.kernels import paged_decode as paged_decode_module
from twinkled.engine.kernels import runnable
from twinkled.engine.kernels.paged_decode import paged_decode, prefix_groups, split_plan
from twinkled.engine.kv_pages import PagePool
from twinkled.engine.running import RunningBatch
from twinkled.engine.sampler import generate
from twinkled.protocol.types import SampleRequest, SamplingParams

pytestmark = pytest.mark.skipif(not runnable(torch.device("cpu")),
                                reason="needs triton and TRITON_INTERPRET=1")


def _reference(pool: PagePool, layer: int, q, k, v, table, lengths, scale):
    """Today's decode attention: write, gather the pages, SDPA under a length mask."""
    size = pool.page_size
    pos = lengths - 1
    write = table.gather(1, (pos // size)[:, None])[:, 0] * size + pos % size
    keys, values = pool.view(write, table).write(layer, k, v)
    mask = (torch.arange(table.shape[1] * size)[None, :] < lengths[:, None])[:, None, None]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _case(heads: int, kv: int, dim: int, page: int, tables: list[list[int]],
          lengths: list[int], pages: int = 24, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    pool = PagePool(2, kv, dim, pages, page, torch.float32, torch.device("cpu"))
    for t in (pool.k, pool.v):
        t.copy_(torch.randn(t.shape, generator=gen))
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    B = len(tables)
    q, k, v = (torch.randn(B, h, 1, dim, generator=gen) for h in (heads, kv, kv))
    return pool, q, k, v, table, torch.tensor(lengths)


# (heads, kv heads, dim, page size, block tables, lengths): pages 1-3 are a prompt shared by
# rows 0 and 1; the last row is an inert padding slot (length 1 at page 0).
CASES = {
    "gqa": (4, 2, 16, 4, [list(range(1, 19)), [1, 2, 3, 4, 5, 19, 20], [21], [0]],
            [70, 27, 3, 1]),
    "mha": (2, 2, 32, 8, [list(range(1, 9)), [1, 2, 9], [0]], [60, 20, 1]),
    "g7 dim 24": (7, 1, 24, 16, [[1, 2, 3], [4], [0]], [40, 16, 1]),
}


@pytest.mark.parametrize("name", CASES)
def test_paged_decode_matches_gather_and_sdpa(name):
    """fp32, to 1e-4: GQA groups (G = 2, 1, 7, padded to 16 rows), rows of different
    lengths, shared pages, an inert row, a head dim that is not a power of two, and several
    splits of a row's tokens (split_plan asks for them when rows are few)."""
    heads, kv, dim, page, tables, lengths = CASES[name]
    pool, q, k, v, table, lens = _case(heads, kv, dim, page, tables, lengths)
    want = _reference(pool, 1, q, k, v, table, lens, 0.3)
    # the reference wrote the new keys/values; the kernel reads them from the pool
    got = paged_decode(q[:, :, 0], pool.k[1], pool.v[1], table, lens, page, 0.3, block_n=16)
    assert got.shape == (len(tables), heads, dim)
    torch.testing.assert_close(got, want[:, :, 0], atol=1e-4, rtol=0)
    assert split_plan(len(tables), kv, table.shape[1] * page, q.device, 16)[0] > 1


def test_paged_decode_tiles_span_pages_and_splits_hold_many_tiles(monkeypatch):
    """Pages of 4 tokens under 16-token tiles: a tile reads 4 pages; on a card of 8 SMs
    (few programs wanted) a split walks 6 tiles; the short rows' second split lies past
    their length and contributes nothing."""
    monkeypatch.setattr(paged_decode_module, "_sms", lambda device: 8)
    tables = [[1 + (i * 3 + j) % 50 for j in range(48)] for i in range(6)]
    lengths = [192, 150, 97, 96, 40, 1]
    pool, q, k, v, table, lens = _case(4, 2, 16, 4, tables, lengths, pages=51, seed=1)
    assert split_plan(6, 2, 192, q.device, 16) == (2, 6)
    want = _reference(pool, 0, q, k, v, table, lens, 0.25)
    got = paged_decode(q[:, :, 0], pool.k[0], pool.v[0], table, lens, 4, 0.25, block_n=16)
    torch.testing.assert_close(got, want[:, :, 0], atol=1e-4, rtol=0)


def test_one_part_a_row_is_written_by_the_split_kernel_as_the_combine_writes_it(monkeypatch):
    """Rows enough that each is one split (a card of 1 SM here): the split kernel writes the
    output itself, no combine; the same bits as the combine of its one partial, and the
    reference's values (an inert row among them). fp32: the interpreter's bf16 attention
    is not the card's (tests/test_kernels_compile.py compiles the bf16 kernel)."""
    dtype = torch.float32
    monkeypatch.setattr(paged_decode_module, "_sms", lambda device: 1)
    heads, kv, dim, page, tables, lengths = CASES["gqa"]
    pool, q, k, v, table, lens = _case(heads, kv, dim, page, tables, lengths)
    assert split_plan(len(tables), kv, table.shape[1] * page, q.device, 16)[0] == 1
    want = _reference(pool, 1, q, k, v, table, lens, 0.3)[:, :, 0]
    kk, vv, qq = pool.k[1].to(dtype), pool.v[1].to(dtype), q[:, :, 0].to(dtype)
    combines = []
    real = paged_decode_module._combine_kernel
    monkeypatch.setattr(paged_decode_module, "_combine_kernel",
                        type("Spy", (), {"__getitem__": lambda _, g: combines.append(g)
                                         or real[g]})())
    got = {}
    for direct in (True, False):
        monkeypatch.setattr(paged_decode_module, "DIRECT", direct)
        got[direct] = paged_decode(qq, kk, vv, table, lens, page, 0.3, block_n=16)
        assert len(combines) == (0 if direct else 1)
    assert got[True].dtype == dtype and torch.equal(got[True], got[False])
    torch.testing.assert_close(got[True], want, atol=1e-4, rtol=0)


def test_split_plan_depends_on_the_shape_only():
    """CUDA graphs replay one launch per bucket: the plan is a function of (rows, kv heads,
    tokens); the splits cover every tile, and one split per row wastes no tile."""
    for rows, kv, tokens in ((1, 8, 16), (256, 8, 12288), (3, 2, 200), (64, 1, 4096)):
        splits, per = split_plan(rows, kv, tokens, torch.device("cpu"))
        assert splits * per * 64 >= tokens
        assert (splits - 1) * per * 64 < tokens  # no split lies wholly past the bucket
    assert split_plan(256, 8, 48 * 16, torch.device("cpu")) == (1, 12)


@pytest.fixture(scope="module")
def eng(tiny_dir):
    return one_adapter_engine(tiny_dir)


def test_running_batch_with_the_kernel_samples_what_the_reference_samples(eng):
    """kernels=True vs False on the tiny model (fp32): the same tokens for seeded and greedy
    sampling, logprobs within 1e-4; shared prompt pages, rows leaving at different steps,
    buckets' inert slots."""
    gen = torch.Generator().manual_seed(0)
    p, q = (torch.randint(5, eng.model.vocab_size, (n,), generator=gen).tolist() for n in (9, 4))

    def params(n, **kw):
        return SamplingParams(max_tokens=n, stop=[], **kw)

    # Few tokens each (every decode step runs the kernel in Triton's interpreter), each
    # request's rows leaving at a step of their own
    reqs = [SampleRequest("a", p, params(4, seed=5), num_samples=3),
            SampleRequest(None, q, params(5, temperature=0.0)),
            SampleRequest("a", q, params(2, temperature=0.8, seed=2), num_samples=2)]
    ads = [None if r.adapter_id is None else eng.pool.get(r.adapter_id) for r in reqs]
    out = {}
    for kernels in (False, True):
        batch = RunningBatch(eng.model, rows=8, pages=32, page_size=4, decode="buckets",
                             kernels=kernels)
        assert batch.decode.kernels is kernels
        out[kernels] = generate(eng.model, reqs, ads, batch=batch)
    assert_same_samples(out[False], out[True])


def test_cpu_takes_the_kernels_only_when_asked(eng, monkeypatch):
    """Default off on CPU; asked for where Triton's interpreter is off, a clear error."""
    assert RunningBatch(eng.model, rows=2, pages=8, page_size=4).decode.kernels is False
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        RunningBatch(eng.model, rows=2, pages=8, page_size=4, kernels=True)


# Cascade: rows 0-7 a group of 8 sharing pages 1-3 (12 tokens), rows 8-10 a group of 3
# sharing pages 20-21, row 11 alone, rows 12 and 14 what is left of a group (its other
# members gone; row 13 moved in between), row 15 an inert slot.
_GROUPED = ([[1, 2, 3, 4 + i, 12 + i] for i in range(8)] + [[20, 21, 22 + i] for i in range(3)]
            + [[25, 26, 27]] + [[28, 29, 30], [31, 32], [28, 29, 33]] + [[0]])
_LENGTHS = [13, 14, 16, 17, 18, 19, 20, 13, 9, 10, 12, 11, 10, 6, 12, 1]
_GROUPS = [5] * 8 + [2] * 3 + [9, 4, 8, 4, 0]
_SHARED = [12] * 8 + [8] * 3 + [0, 8, 0, 8, 0]


@pytest.mark.parametrize("chunk", [8, 3])
def test_cascade_matches_gather_and_sdpa(chunk, monkeypatch):
    """fp32, to 1e-5: groups of 8, 3 and 1, a group whose rows are no longer adjacent
    (rows left, compaction moved another in), an inert slot; a chunk of 3 splits the groups
    of 8 and 3 over several programs, and prefix tiles of 16 tokens give the prefix several
    tiles and splits. The shared prefix is read by the prefix kernel, each row's own tokens
    by the split kernel, merged by the combine."""
    if chunk == 3:
        monkeypatch.setitem(paged_decode_module.TUNE, "prefix_block_n", 16)
    pool, q, k, v, table, lens = _case(4, 2, 16, 4, _GROUPED, _LENGTHS, pages=36, seed=2)
    want = _reference(pool, 1, q, k, v, table, lens, 0.3)
    prefix = prefix_groups(torch.tensor(_GROUPS), torch.tensor(_SHARED), chunk)
    counts = prefix.count.tolist()
    assert sorted(c for c in counts if c) == ([2, 3, 8] if chunk == 8 else [2, 2, 3, 3, 3])
    assert prefix.chunks.item() == (3 if chunk == 8 else 5)
    got = paged_decode(q[:, :, 0], pool.k[1], pool.v[1], table, lens, 4, 0.3, block_n=16,
                       prefix=prefix)
    torch.testing.assert_close(got, want[:, :, 0], atol=1e-5, rtol=0)


def test_prefix_groups_chunks_each_group():
    """Every row that shares a prefix is in exactly one chunk, listed in `starts`; a chunk's
    rows are one group's; rows sharing nothing are in none."""
    prefix = prefix_groups(torch.tensor(_GROUPS), torch.tensor(_SHARED), 3)
    order, count = prefix.order.tolist(), prefix.count.tolist()
    starts = prefix.starts.tolist()[:prefix.chunks.item()]
    chunks = [order[j:j + count[j]] for j in starts]
    assert all(count[j] == 0 for j in range(len(order)) if j not in starts)
    assert sorted(r for c in chunks for r in c) == [r for r, t in enumerate(_SHARED) if t]
    for c in chunks:
        assert len({(_GROUPS[r], _SHARED[r]) for r in c}) == 1
    assert [12, 14] in chunks


def test_cascade_samples_what_the_flat_kernel_samples(eng, monkeypatch):
    """RunningBatch with cascade on and off (kernels on, fp32, graphs' bucket sizes): the
    same tokens for seeded sampling, logprobs within 1e-5, while another request's rows
    leave and the group's rows move slots; the prefix path ran. A batch of lone samples
    never takes it."""
    calls = []
    real = paged_decode_module.prefix_groups
    monkeypatch.setattr(paged_decode_module, "prefix_groups",
                        lambda *a: calls.append(a) or real(*a))
    gen = torch.Generator().manual_seed(1)
    p, q = (torch.randint(5, eng.model.vocab_size, (n,), generator=gen).tolist() for n in (3, 11))
    reqs = [SampleRequest("a", p, SamplingParams(max_tokens=2, stop=[], seed=4), num_samples=2),
            SampleRequest("a", q, SamplingParams(max_tokens=4, stop=[], seed=7), num_samples=4)]
    ads = [eng.pool.get("a")] * 2
    out = {}
    for cascade in (False, True):
        batch = RunningBatch(eng.model, rows=8, pages=40, page_size=4, decode="buckets",
                             kernels=True, cascade=cascade)
        out[cascade] = generate(eng.model, reqs, ads, batch=batch)
    assert calls  # the cascade ran (and only it: the flat batch never chunks)
    for ref, got in zip(out[False], out[True], strict=True):
        for x, y in zip(ref.sequences, got.sequences, strict=True):
            assert x.tokens == y.tokens
            assert y.logprobs == pytest.approx(x.logprobs, abs=1e-5)
    calls.clear()
    lone = RunningBatch(eng.model, rows=4, pages=40, page_size=4, decode="buckets",
                        kernels=True)
    assert lone.decode.cascade
    generate(eng.model, [SampleRequest("a", q, SamplingParams(max_tokens=2, stop=[]))],
             ads[:1], batch=lone)
    assert not calls
