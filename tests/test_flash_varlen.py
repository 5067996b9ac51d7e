"""Packed training attention through flash's own varlen ops (engine/flash_varlen.py): the
merge of the own and prefix calls and the backward built from the two calls' backwards give
what SDPA with masks gives, forward and gradients, under GQA. On CPU the calls are
`REFERENCE` (flash's semantics in plain torch); the GPU runs `FLASH`."""

import pytest
import torch

from twinkled.engine import flash_varlen as fv
from twinkled.engine.packed import Packing
from twinkled.engine.shared_prefix import SharedPacking

# a row alone, a shared start and three continuations (one of one position), another row
# alone, a second shared start with two continuations, and a last row alone
SPANS = [(0, 3, 0), (3, 5, 0), (8, 2, 5), (10, 1, 5), (11, 1, 5), (12, 2, 0),
         (14, 4, 0), (18, 3, 4), (21, 2, 4), (23, 2, 0)]
PREFIXES = [None, None, (3, 5), (3, 5), (3, 5), None, None, (14, 4), (14, 4), None]


def _qkv(T: int, heads: int = 4, kv: int = 2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, T, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, kv, T, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    return [t.requires_grad_() for t in (q, k, v)]


def _grads(fn, q, k, v, seed: int = 3):
    out = fn(q, k, v)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed),
                    dtype=out.dtype).to(out.device)
    (out * w).sum().backward()
    got = [out.detach()] + [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    return got


@pytest.mark.parametrize("first_alone", [True, False])
def test_shared_prefixes_read_in_place_equal_the_masked_reference(first_alone):
    spans, prefixes = (SPANS, PREFIXES) if first_alone else (SPANS[1:], PREFIXES[1:])
    if not first_alone:  # the packing starts with a shared segment (its filler has no keys)
        spans = [(s - 3, n, lo) for s, n, lo in spans]
        prefixes = [None if p is None else (p[0] - 3, p[1]) for p in prefixes]
    T = spans[-1][0] + spans[-1][1]
    packing = SharedPacking.of(spans, prefixes, "cpu")
    plan = packing.plan  # made when first asked for
    assert plan.prefix is not None and int(plan.covered.sum()) == sum(
        n for (_, n, _), p in zip(spans, prefixes, strict=True) if p is not None)
    q, k, v = _qkv(T)
    want = _grads(lambda *a: packing.attend(*a, 0.3, True), q, k, v)
    got = _grads(lambda *a: fv.attend(*a, plan, 0.3, fv.REFERENCE), q, k, v)
    for w, g, name in zip(want, got, ("out", "dq", "dk", "dv"), strict=True):
        assert torch.allclose(g, w, atol=1e-10), name


def test_plain_packing_keeps_fewer_kv_heads_and_equals_sdpa():
    lengths = [5, 1, 7, 3]
    packing = Packing.of(lengths, "cpu")
    starts = packing.cu.tolist()
    plan = fv.Plan.of([(s, n) for s, n in zip(starts, lengths, strict=False)], None, "cpu")
    assert plan.prefix is None and plan.own.max_q == 7
    q, k, v = _qkv(sum(lengths), heads=6, kv=2, seed=1)
    want = _grads(lambda *a: packing.attend(*a, 0.5, True), q, k, v)
    got = _grads(lambda *a: fv.attend(*a, plan, 0.5, fv.REFERENCE), q, k, v)
    assert got[2].shape == k.shape  # gradients per kv head, not per repeated head
    for w, g in zip(want, got, strict=True):
        assert torch.allclose(g, w, atol=1e-10)


def test_a_continuation_before_its_prefix_is_refused():
    with pytest.raises(ValueError, match="precede"):
        fv.Plan.of([(0, 2), (2, 3), (5, 2)], [None, (5, 2), None], "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention's CUDA kernels")
@pytest.mark.parametrize("first_alone", [True, False])
def test_flash_kernels_equal_the_reference_on_a_gpu(first_alone):
    """Also where the packing starts with a shared segment (a filler with no keys) and
    ends with continuations (keys after the last prefix in no segment of that call)."""
    spans, prefixes = (SPANS, PREFIXES) if first_alone else (
        [(s - 3, n, lo) for s, n, lo in SPANS[1:-1]],
        [None if p is None else (p[0] - 3, p[1]) for p in PREFIXES[1:-1]])
    T = spans[-1][0] + spans[-1][1]
    plan = fv.Plan.of([(s, n) for s, n, _ in spans], prefixes, "cuda")
    q, k, v = (t.detach().to("cuda", torch.bfloat16).requires_grad_() for t in _qkv(T))
    want = _grads(lambda *a: fv.attend(*a, plan, 0.3, fv.REFERENCE), q, k, v)
    got = _grads(lambda *a: fv.attend(*a, plan, 0.3, fv.FLASH), q, k, v)
    for w, g, name in zip(want, got, ("out", "dq", "dk", "dv"), strict=True):
        # bf16 inputs, fp32 sums on both sides, bf16 results: a few ulps of the largest
        err, scale = (g.float() - w.float()).abs().max(), w.float().abs().max()
        assert torch.isfinite(g).all() and err <= 2e-2 * scale + 1e-3, (name, float(err),
                                                                         float(scale))
