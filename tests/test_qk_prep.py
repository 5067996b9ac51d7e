"""The decode step's q/k prep kernel (engine/kernels/qk_prep.py) against the reference ops it
replaces: fused_ops' eager norm and rotation (the reference path off CUDA), liger's kernels
(on CUDA; on CPU their rounding steps) and the index_copy_ of kv_pages.PagedView.store; and
a running batch sampling the same with it on and off. In Triton's interpreter on CPU
(conftest sets TRITON_INTERPRET=1); on a GPU (TWINKLE_TEST_DEVICE=cuda, TRITON_INTERPRET=0:
gpu_pass.sh gpucheck) compiled."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, assert_same_samples, one_adapter_engine

from twinkled.engine import fused_ops
from twinkled.engine.kernels import qk_prep as qk_prep_module
from twinkled.engine.kernels import runnable
from twinkled.engine.running import RunningBatch
from twinkled.engine.sampler import generate
from twinkled.protocol.types import SampleRequest, SamplingParams

pytestmark = pytest.mark.skipif(not runnable(torch.device(DEVICE)),
                                reason="needs triton (CPU: TRITON_INTERPRET=1)")

SLOTS = 40


def _inputs(dtype, heads: int, kv: int, dim: int, joint: bool, rows: int = 5, seed: int = 0):
    """q/k/v [B, 1, H, D]: views of one joint output with 3 spare columns (a row stride no
    head count gives), or (joint=False, as a LoRA's new tensors leave them) tensors of their
    own; cos/sin from real angles (cat(freqs, freqs), as the model's rotary); each row at a
    slot of its own, the pools' other slots random (so a stray write shows)."""
    gen, dev = torch.Generator().manual_seed(seed), torch.device(DEVICE)
    widths = [heads * dim, kv * dim, kv * dim]
    if joint:
        y = (torch.randn((rows, 1, sum(widths) + 3), generator=gen) * 2).to(dev, dtype)
        q, k, v = (t.view(rows, 1, -1, dim) for t in y[..., 3:].split(widths, -1))
    else:
        q, k, v = ((torch.randn((rows, 1, w), generator=gen) * 2).to(dev, dtype)
                   .view(rows, 1, -1, dim) for w in widths)
    freqs = torch.rand((rows, 1, dim // 2), generator=gen) * 50
    cos, sin = (torch.cat([f(freqs)] * 2, -1).to(dev, dtype) for f in (torch.cos, torch.sin))
    weights = [(1 + torch.randn(dim, generator=gen) / 3).to(dev, dtype) for _ in range(2)]
    pools = [torch.randn((SLOTS, kv, dim), generator=gen).to(dev, dtype) for _ in range(2)]
    slots = torch.randperm(SLOTS, generator=gen)[:rows].to(dev)
    return q, k, v, cos, sin, weights, pools, slots


def _eager(q, k, cos, sin, norms):
    """model._attention's reference ops off CUDA: fused_ops' eager norm and rotation."""
    if norms is not None:
        q = fused_ops.rms_norm(q, norms[0], norms[2], kernel=False)
        k = fused_ops.rms_norm(k, norms[1], norms[3], kernel=False)
    return tuple(fused_ops.rotate(t.transpose(1, 2), cos, sin) for t in (q, k))


def _liger(q, k, cos, sin, norms):
    """... on CUDA: liger's kernels (its rope rotates in place: copies of the inputs)."""
    if norms is not None:
        q = fused_ops.rms_norm(q, norms[0], norms[2], kernel=True)
        k = fused_ops.rms_norm(k, norms[1], norms[3], kernel=True)
    q, k = (t.clone().transpose(1, 2) for t in (q, k))
    return fused_ops.rope(q, k, cos, sin, kernel=True)


def _as_liger(q, k, cos, sin, norms):
    """liger's rounding where its kernels cannot run compiled (CPU): the eager norm (the same
    steps), and its rope as it compiles for sm_90 (mul.bf16 of x2 * sin, fma.rn.bf16 of
    x1 * cos minus that, in the first half; x2 * cos rounded, x1 * sin fused in the second)."""
    f32 = torch.float32
    h = q.shape[-1] // 2
    (c1, c2), (s1, s2) = (t[:, None].split(h, -1) for t in (cos, sin))

    def rope(x):
        x1, x2 = x[..., :h], x[..., h:]
        y1 = x1.to(f32) * c1.to(f32) - (x2 * s1).to(f32)
        y2 = x1.to(f32) * s2.to(f32) + (x2 * c2).to(f32)
        return torch.cat([y1, y2], -1).to(x.dtype)

    q, k = _eager(q, k, torch.ones_like(cos), torch.zeros_like(sin), norms)  # (norms only)
    return rope(q), rope(k)


def _reference(q, k, v, cos, sin, norms, pools, slots, ops=_eager):
    """q and k normed and rotated by `ops`, then PagedView.store's copies into the pools."""
    q, k = ops(q, k, cos, sin, norms)
    keys, values = (p.clone() for p in pools)
    keys.index_copy_(0, slots, k[:, :, 0])
    values.index_copy_(0, slots, v[:, 0])
    return q[:, :, 0], keys, values


def _assert_close(got, want, dtype):
    """fp32: 1e-5 (the mean square's summation order, rsqrt's last bits, an fma). bf16: an
    ulp of the element plus one of its head's largest: the eager rotation rounds a product
    that liger's (and the kernel's) keeps exact, and where the sum cancels, half an ulp of
    the product is more than an ulp of the result (about a quarter of the elements differ
    from the eager path; from liger, a last bit of rstd: few)."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        return
    g, w = got.float(), want.float()
    bound = torch.finfo(dtype).eps * (w.abs() + w.abs().amax(-1, keepdim=True))
    assert ((g - w).abs() <= bound).all(), ((g - w).abs() / bound).max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "no_norm"])
@pytest.mark.parametrize("shape,joint", [((4, 2, 32), True), ((8, 2, 128), False),
                                         ((3, 1, 24), True)], ids=["gqa", "8b_heads", "dim24"])
def test_the_kernel_matches_norm_rotate_and_store(dtype, norm, shape, joint):
    """Rows at different slots; q/k/v read by strides from a joint output (or tensors of
    their own); with Qwen3's q/k norms and without (Qwen2, Llama); head dims of 32, 128 and
    24 (halves no power of two: masked lanes). The rotated q comes back contiguous
    [B, Hq, D]; the pools hold the normed, rotated k and the v at the rows' slots and are
    unchanged everywhere else (compared whole)."""
    q, k, v, cos, sin, (qw, kw), pools, slots = _inputs(dtype, *shape, joint)
    norms = (qw, kw, 1e-6, 1e-5) if norm else None
    want_q, want_k, want_v = _reference(q, k, v, cos, sin, norms, pools, slots)
    keys, values = (p.clone() for p in pools)
    got_q = qk_prep_module.qk_prep(q, k, v, cos, sin, norms, keys, values, slots)
    assert got_q.shape == want_q.shape and got_q.is_contiguous() and got_q.dtype == dtype
    _assert_close(got_q, want_q, dtype)
    _assert_close(keys, want_k, dtype)
    assert torch.equal(values, want_v)
    others = torch.ones(SLOTS, dtype=torch.bool, device=slots.device)
    others[slots] = False
    assert torch.equal(keys[others], pools[0][others])
    assert not torch.equal(keys[slots], pools[0][slots])  # (and it did write)


@pytest.mark.parametrize("ops", ["as_liger", "liger"])
def test_bf16_rounds_where_liger_rounds(ops):
    """bf16, heads of 128, 8 rows, against liger's kernels (on CUDA: the reference path
    there) or their rounding steps (_as_liger): all but a few elements the same bits (only
    rstd's last bit may differ). A kernel rounding the rotation once, or both its products,
    differs in about a third, or a quarter, of them."""
    if ops == "liger" and not fused_ops.liger_usable(torch.device(DEVICE)):
        pytest.skip("liger's kernels compiled: CUDA with liger-kernel")
    q, k, v, cos, sin, (qw, kw), pools, slots = _inputs(torch.bfloat16, 16, 4, 128, True,
                                                        rows=8, seed=1)
    for norms in ((qw, kw, 1e-6, 1e-6), None):
        want_q, want_k, _ = _reference(q, k, v, cos, sin, norms, pools, slots,
                                       _as_liger if ops == "as_liger" else _liger)
        keys, values = (p.clone() for p in pools)
        got_q = qk_prep_module.qk_prep(q, k, v, cos, sin, norms, keys, values, slots)
        _assert_close(got_q, want_q, torch.bfloat16)
        _assert_close(keys, want_k, torch.bfloat16)
        differ = (got_q != want_q).sum().item() + (keys[slots] != want_k[slots]).sum().item()
        assert differ <= 0.001 * 2 * got_q.numel()


@pytest.fixture(scope="module")
def eng(tiny_dir):
    return one_adapter_engine(tiny_dir)


def test_a_running_batch_samples_the_same_with_the_prep_kernel(eng, monkeypatch):
    """The tiny Qwen3 (q/k norms; fp32), kernels on, the `prep` lever on and off: the same
    tokens for seeded and greedy sampling, logprobs within 1e-4, rows of an adapter and of
    the base model leaving at different steps, buckets' inert slots; the kernel ran on every
    decode layer with the lever on, never with it off."""
    calls = []
    real = qk_prep_module.qk_prep
    monkeypatch.setattr(qk_prep_module, "qk_prep", lambda *a: calls.append(a) or real(*a))
    gen = torch.Generator().manual_seed(3)
    p, q = (torch.randint(5, eng.model.vocab_size, (n,), generator=gen).tolist() for n in (7, 5))
    reqs = [SampleRequest("a", p, SamplingParams(max_tokens=4, stop=[], seed=5), num_samples=2),
            SampleRequest(None, q, SamplingParams(max_tokens=3, stop=[], temperature=0.0)),
            SampleRequest("a", q, SamplingParams(max_tokens=2, stop=[], temperature=0.8, seed=2))]
    ads = [None if r.adapter_id is None else eng.pool.get(r.adapter_id) for r in reqs]
    out = {}
    try:
        for prep in (False, True):
            eng.model.fused.prep = prep
            batch = RunningBatch(eng.model, rows=8, pages=32, page_size=4, decode="buckets",
                                 kernels=True)
            out[prep] = generate(eng.model, reqs, ads, batch=batch)
            assert bool(calls) is prep
    finally:
        eng.model.fused.prep = True
    assert len(calls) % len(eng.model.layers) == 0 and calls[0][5] is not None  # (q/k norms)
    assert_same_samples(out[False], out[True])
