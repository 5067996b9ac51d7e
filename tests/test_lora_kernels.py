"""The multi-LoRA row kernels (engine/kernels/lora_decode.py) against the masked reference
(lora_rows.RowLora), in Triton's interpreter (conftest sets TRITON_INTERPRET=1): the same
deltas for rows of mixed adapters and ranks, base-model rows and padding, and the same
samples from a running batch with the kernels on and off."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, make_engine, randomize_b

from twinkled.engine.kernels import lora_decode
from twinkled.engine.lora_rows import AdapterStack, KernelRowLora, RowLora, row_lora
from twinkled.engine.running import RunningBatch
from twinkled.engine.sampler import generate
from twinkled.protocol.types import LoraConfig, SampleRequest, SamplingParams

# (first column, rank, scale) of the adapters in a stack of width 128; ranks not powers of
# two, and one of 64 (the widest tile the brief asks for)
ADAPTERS = [(0, 8, 0.5), (8, 20, 2.0), (40, 64, 1.5), (104, 3, -0.75)]


def _rows(n: int, gen: torch.Generator):
    """n rows, each of a random adapter or (index 4) the base model."""
    pick = torch.randint(0, len(ADAPTERS) + 1, (n,), generator=gen).tolist()
    start, rank, scale = zip(*(ADAPTERS[i] if i < len(ADAPTERS) else (0, 0, 0.0) for i in pick),
                             strict=True)
    return (torch.tensor(start, dtype=torch.int32), torch.tensor(rank, dtype=torch.int32),
            torch.tensor(scale, dtype=torch.float32))


def _masked(start, rank, scale, width: int) -> torch.Tensor:
    mask = torch.zeros((len(start), width))
    for b, (s, r, c) in enumerate(zip(start.tolist(), rank.tolist(), scale.tolist(), strict=True)):
        mask[b, s:s + r] = c
    return mask


@pytest.mark.parametrize("partials", [8, 3, 1])
@pytest.mark.parametrize("chunk", [None, 64, 32])
def test_row_kernels_match_the_masked_reference(chunk, partials, monkeypatch):
    """37 rows (two full windows of 16 and a partial one): four adapters of ranks 8, 20,
    64 and 3 mixed with base-model rows; reduction and output sizes that no tile divides
    (the expand's program of NB column tiles, most of them past the 150 outputs); the
    shrink's reduction (200) in chunks of 200, 64 and 32, a chunk a partial sum (PARTIALS
    8), several a partial with the last program's chunks past the end (3: 7 chunks of 32
    in partials of 3), or all in one (1)."""
    monkeypatch.setattr(lora_decode, "PARTIALS", partials)
    gen = torch.Generator().manual_seed(0)
    n, k, out, width = 37, 200, 150, 128
    x = torch.randn((n, k), generator=gen)
    A = torch.randn((width, k), generator=gen) / k ** 0.5
    B = torch.randn((out, width), generator=gen) / 8
    y = torch.randn((n, out), generator=gen)
    start, rank, scale = _rows(n, gen)
    assert (rank == 0).any() and len(set(rank.tolist())) == 5  # every kind of row is there
    want = y + (x @ A.T * _masked(start, rank, scale, width)) @ B.T
    got = lora_decode.apply(lora_decode.plan(start, rank, scale), x, A, B, y.clone(), 64, chunk)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    base = rank == 0
    assert torch.equal(got[base], y[base])  # the base model's rows are left as they were


@pytest.mark.parametrize("chunk", [None, 32])
def test_a_rows_delta_does_not_depend_on_the_batch(chunk):
    """The same rows alone (5), in a batch of 40 and of 200 (a prefill's size, its partial
    sums summed before the expand): the same bits. A prefix cache's samples rely on it (a
    cached prompt's rows meet other batches than the uncached run's)."""
    gen = torch.Generator().manual_seed(4)
    k, out, width = 200, 150, 128
    A = torch.randn((width, k), generator=gen) / k ** 0.5
    B = torch.randn((out, width), generator=gen) / 8
    start, rank, scale = _rows(200, gen)
    x, y = torch.randn((200, k), generator=gen), torch.randn((200, out), generator=gen)
    got = {n: lora_decode.apply(lora_decode.plan(start[:n], rank[:n], scale[:n]), x[:n], A, B,
                                y[:n].clone(), 64, chunk)[:5]
           for n in (5, 40, 200)}
    assert torch.equal(got[5], got[40]) and torch.equal(got[5], got[200])
    assert not torch.equal(got[5], y[:5])


def test_rows_of_many_tokens_use_their_rows_adapter(monkeypatch):
    """KernelRowLora on [rows, tokens, in] (a prefill; its partial sums summed before the
    expand, as for more than SUM_ROWS tokens) equals RowLora with the same stack, and a
    key the stack does not hold leaves y alone."""
    monkeypatch.setattr(lora_decode, "SUM_ROWS", 8)
    monkeypatch.setattr(lora_decode, "CHUNK", {4: 16})  # 3 partial sums of in = 48
    gen = torch.Generator().manual_seed(1)
    stack = AdapterStack(torch.float32, torch.device("cpu"), width=128)
    stack.rank_block = 64
    stack.A["q"] = torch.randn((128, 48), generator=gen) / 7
    stack.B["q"] = torch.randn((40, 128), generator=gen) / 8
    start, rank, scale = _rows(6, gen)
    x = torch.randn((6, 5, 48), generator=gen)
    y = torch.randn((6, 5, 40), generator=gen)
    want = RowLora(stack, _masked(start, rank, scale, 128)).apply("q", x, y.clone())
    lora = KernelRowLora(stack, start, rank, scale)
    torch.testing.assert_close(lora.apply("q", x, y.clone()), want, rtol=1e-5, atol=1e-5)
    assert lora.apply("k", x, y) is y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 4])
def test_modules_sharing_an_input_in_one_launch_add_the_same_bits(dtype, tokens, monkeypatch):
    """apply_shared (q/k/v, gate/up: one shrink and one expand for the group) against the
    modules one at a time, on views of one joint output as the fused GEMM leaves them:
    the same bits, every module's columns written and no others; a key the stack does not
    hold is left alone. Outputs that no column block divides (150, 40, 72); with 4 tokens a
    row the partial sums are summed first (a prefill's path). On a GPU (TWINKLE_TEST_DEVICE
    =cuda, TRITON_INTERPRET=0: gpu_pass.sh gpucheck) the compiled kernels."""
    monkeypatch.setattr(lora_decode, "SUM_ROWS", 8)
    gen, dev = torch.Generator().manual_seed(3), torch.device(DEVICE)
    stack = AdapterStack(dtype, dev, width=128)
    stack.rank_block = 64
    outs = {"q": 150, "k": 40, "v": 72}
    for key, out in outs.items():
        stack.A[key] = (torch.randn((128, 200), generator=gen) / 14).to(dev, dtype)
        stack.B[key] = (torch.randn((out, 128), generator=gen) / 8).to(dev, dtype)
    start, rank, scale = (t.to(dev) for t in _rows(21, gen))
    x = torch.randn((21, tokens, 200), generator=gen).to(dev, dtype)
    joint = torch.randn((21, tokens, sum(outs.values())), generator=gen).to(dev, dtype)

    def views(y):
        return list(y.split(list(outs.values()), dim=-1))

    for keys in (("q", "k", "v"), ("k", "v"), ("q", "absent", "v")):
        want, got = joint.clone(), joint.clone()
        one = KernelRowLora(stack, start, rank, scale)
        for key, y in zip(("q", "k", "v"), views(want), strict=True):
            if key in keys:
                one.apply(key, x, y)
        picked = [dict(zip(("q", "k", "v"), views(got), strict=True)).get(k, None)
                  for k in keys]
        if "absent" in keys:
            picked[1] = torch.zeros((21, tokens, 5), dtype=dtype, device=dev)
            untouched = picked[1].clone()
        back = KernelRowLora(stack, start, rank, scale).apply_shared(keys, x, picked)
        assert torch.equal(got, want), keys
        assert not torch.equal(got, joint)  # the deltas went in
        assert all(b is p for b, p in zip(back, picked, strict=True))
        if "absent" in keys:
            assert torch.equal(picked[1], untouched)


@pytest.fixture(scope="module")
def eng(tiny_dir):
    e = make_engine(tiny_dir)
    e.add_adapter("a", LoraConfig(rank=4, alpha=16, seed=0))
    e.add_adapter("b", LoraConfig(rank=2, alpha=8, seed=1, train_unembed=False))
    e.add_adapter("c", LoraConfig(rank=20, alpha=10, seed=2, train_mlp=False))
    for i, name in enumerate("abc"):
        randomize_b(e, name, seed=30 + i, std=0.3)
    return e


def test_a_running_batch_samples_the_same_with_the_kernels(eng):
    """Adapters of ranks 4, 2 and 20 (it widens the kernels' column tile mid-batch) and the
    base model, seeded and greedy, at the CUDA graphs' padded sizes: the kernels give the
    masked path's tokens and logprobs."""
    gen = torch.Generator().manual_seed(2)

    def prompt(n):
        return torch.randint(5, eng.model.vocab_size, (n,), generator=gen).tolist()

    def params(n, **kw):
        return SamplingParams(max_tokens=n, stop=[], **kw)

    # Few tokens each: every decode step runs the kernels in Triton's interpreter (~3 s)
    reqs = [SampleRequest("a", prompt(7), params(3, seed=5), num_samples=2),
            SampleRequest("b", prompt(5), params(2, temperature=0.8, seed=6, top_p=0.9)),
            SampleRequest(None, prompt(4), params(2, seed=7)),
            SampleRequest("c", prompt(9), params(3, temperature=0.0))]
    ads = [None if r.adapter_id is None else eng.pool.get(r.adapter_id) for r in reqs]
    out = {}
    for kernels in (False, True):
        batch = RunningBatch(eng.model, rows=8, pages=48, page_size=4, decode="buckets",
                             kernels=kernels)
        out[kernels] = generate(eng.model, reqs[:2], ads[:2], batch=batch)
        out[kernels] += generate(eng.model, reqs[2:], ads[2:], batch=batch)  # rank 20 joins
    assert batch.stack.rank_block == 32
    for g, w in zip(out[True], out[False], strict=True):
        assert [s.tokens for s in g.sequences] == [s.tokens for s in w.sequences]
        for x, y in zip(g.sequences, w.sequences, strict=True):
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)
    assert len({tuple(s.tokens) for r in out[True] for s in r.sequences}) > 3  # not all alike


def test_kernels_on_a_cpu_without_the_interpreter_are_refused(eng, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="cannot run on cpu"):
        RunningBatch(eng.model, rows=2, pages=8, page_size=4, kernels=True)
    assert not RunningBatch(eng.model, rows=2, pages=8, page_size=4).kernels  # CPU default
    assert isinstance(row_lora(AdapterStack(torch.float32, torch.device("cpu")), [None], False),
                      RowLora)


def test_kernel_rows_give_the_masked_rows_factors():
    """A caller that applies a row's LoRA in pieces of its own (mla.py's absorbed decode)
    gets the same factors from the kernels' rows as from the masked reference's."""
    stack = AdapterStack(torch.float32, torch.device("cpu"), width=128)
    gen = torch.Generator().manual_seed(2)
    stack.A["m"] = torch.randn((128, 16), generator=gen)
    stack.B["m"] = torch.randn((24, 128), generator=gen)
    start, rank, scale = _rows(9, gen)
    masked = RowLora(stack, _masked(start, rank, scale, 128))
    kernel = KernelRowLora(stack, start, rank, scale)
    for got, want in zip(kernel.row_factors("m"), masked.row_factors("m"), strict=True):
        assert torch.equal(got, want)
    assert kernel.row_factors("other") is None and masked.row_factors("other") is None
