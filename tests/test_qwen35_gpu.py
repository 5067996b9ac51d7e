"""Qwen3.5 on a GPU: fla-core's chunked delta-rule kernel (varlen, cu_seqlens) against the
torch delta rule, and the model's training and sampling paths on CUDA (with fla-core where
installed, pip extra `gpu`, against the torch rule). Skips without CUDA."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import delta_rule_inputs

from twinkled.engine import fla_dqkwg
from twinkled.engine import linear_attn as la

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _inputs(dtype, lengths):
    (q, k, v, gate, beta, s0), real = delta_rule_inputs(lengths, dk=64, dv=32)
    return [t.cuda().to(dtype) for t in (q, k, v)] + [t.cuda() for t in (gate, beta, s0)], real


def _torch_rule(q, k, v, gate, beta, s0):
    rep = v.shape[2] // q.shape[2]
    q, k = (la.l2norm(t.float().repeat_interleave(rep, dim=2)) for t in (q, k))
    return la.delta_rule(q * q.shape[-1]**-0.5, k, v, gate, beta, s0)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 5e-2)])
def test_fla_rule_equals_the_torch_rule(dtype, tol):
    pytest.importorskip("fla.ops.gated_delta_rule")
    lengths = [37, 200, 5, 64]
    (q, k, v, gate, beta, s0), real = _inputs(dtype, lengths)
    for t in (q, k, v):
        t.requires_grad_(True)
    o, s = la.fla_rule(q, k, v, gate, beta, s0, lengths)
    m = real[..., None].cuda()
    o2, s2 = _torch_rule(q, k, v, gate, beta, s0)
    assert ((o.float() - o2.float()) * m).abs().max() < tol
    assert (s.float() - s2).abs().max() < tol
    if la.fla_backward_broken():  # fla refuses its gated backward here (Hopper, Triton
        assert not la.fla_usable(o, backward=True)  # < 3.7.1): training takes the torch rule
    else:
        _same_grads(o, o2, (q, k, v), m, tol * 10)
    # one token per row (decode): the fused recurrent kernel against delta_step
    one = [t[:, :1].contiguous() for t in (q.detach(), k.detach(), v.detach(), gate, beta)]
    o, s = la.fla_step(*one, s0)
    rep = v.shape[2] // q.shape[2]
    q1, k1 = (la.l2norm(t.float().repeat_interleave(rep, dim=2)) for t in one[:2])
    o2, s2 = la.delta_step(q1 * q1.shape[-1]**-0.5, k1, *one[2:], s0)
    assert (o.float() - o2.float()).abs().max() < tol and (s - s2).abs().max() < tol


def _same_grads(o, o2, inputs, m, tol, relative=False):
    """Gradients of o and o2 for a random upstream (real positions only) agree within tol
    (relative: a fraction of each input's largest gradient)."""
    w = torch.randn_like(o.float()) * m
    g1 = torch.autograd.grad((o.float() * w).sum(), inputs, retain_graph=True)
    g2 = torch.autograd.grad((o2.float() * w).sum(), inputs, retain_graph=True)
    for a, b in zip(g1, g2, strict=True):
        top = b.float().abs().max() if relative else 1.0
        assert (a.float() - b.float()).abs().max() < tol * top


@pytest.fixture
def torch_dqkwg(monkeypatch):
    """la.TORCH_DQKWG on, on a card where fla refuses its gated backward (Hopper, Triton <
    3.7.1): fla's backward runs with engine/fla_dqkwg.py in place of its one wrong kernel.
    Yields the calls that reached our kernel."""
    pytest.importorskip("fla.ops.gated_delta_rule")
    la.fla_backward_broken.cache_clear()
    if not la.fla_backward_broken():
        pytest.skip("fla's own gated backward runs on this card: nothing to replace")
    monkeypatch.setattr(la, "TORCH_DQKWG", True)
    la.fla_backward_broken.cache_clear()
    calls, ours = [], fla_dqkwg.chunk_bwd_dqkwg
    monkeypatch.setattr(fla_dqkwg, "chunk_bwd_dqkwg",
                        lambda *a, **kw: calls.append(1) or ours(*a, **kw))
    yield calls
    la.fla_backward_broken.cache_clear()  # (the switch goes back off with monkeypatch)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 5e-2)])
def test_torch_dqkwg_fla_rule_gradients_equal_the_torch_rule(dtype, tol, torch_dqkwg):
    lengths = [37, 200, 5, 64]
    (q, k, v, gate, beta, s0), real = _inputs(dtype, lengths)
    inputs = (q, k, v, gate, beta, s0)
    for t in inputs:
        t.requires_grad_(True)
    assert la.fla_usable(q, backward=True)  # training takes fla_rule
    o, s = la.fla_rule(q, k, v, gate, beta, s0, lengths)
    o2, s2 = _torch_rule(q, k, v, gate, beta, s0)
    # (relative: gate's and beta's gradients reach ~0.7 here, where bf16's tol * 10 is 0.5)
    _same_grads(o, o2, inputs, real[..., None].cuda(), tol * 5, relative=True)
    assert torch_dqkwg  # through our kernel, not fla's


def test_torch_dqkwg_tiny_model_trains_through_fla_as_the_torch_rule(tmp_path, torch_dqkwg):
    from twinkled.engine.model import BaseModel
    from twinkled.engine.packed import Packing
    from twinkled.engine.tiny import build_tiny_model

    d = build_tiny_model(tmp_path / "q35", arch="qwen3_5", num_layers=4, num_heads=2,
                         hidden_size=128, embed_std=0.05)
    m = BaseModel(d, dtype="float32", device="cuda")
    # the linear-attention layers' own weights: their gradients pass through q, k, v, g, beta
    params = [p for i in m.hybrid.linear for p in (
        m.layers[i].linear_attn.A_log, m.layers[i].linear_attn.dt_bias,
        m.layers[i].linear_attn.conv1d.weight)]
    for p in params:
        p.requires_grad_(True)
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, m.vocab_size, (n,), generator=gen).tolist() for n in (70, 9, 150)]
    pk = Packing.of([len(r) for r in rows], "cuda")
    ids = torch.tensor([t for r in rows for t in r], device="cuda")[None]
    got = []
    for fla in (True, False):  # fla_rule with our kernel, then the torch rule
        m.hybrid.fla = fla
        lp = m.logits(m.forward(ids, pk.positions, packing=pk)).float().log_softmax(-1)
        got.append(torch.autograd.grad(lp[0, torch.arange(ids.shape[1]), ids[0]].sum(), params))
    m.hybrid.fla = True
    assert torch_dqkwg
    for a, b in zip(*got, strict=True):  # (relative: A_log's gradients are ~1e-3 here)
        assert b.abs().max() > 0 and (a - b).abs().max() < 2e-2 * b.abs().max()


@pytest.mark.parametrize("heads", [2, 1])  # head_dim 64, and 256 as Qwen3.5-9B has
def test_model_on_cuda_trains_and_samples_as_the_reference(tmp_path, heads):
    from twinkled.engine.model import BaseModel
    from twinkled.engine.packed import Packing
    from twinkled.engine.running import RunningBatch
    from twinkled.engine.sampler import generate
    from twinkled.engine.tiny import build_tiny_model
    from twinkled.protocol.types import SampleRequest, SamplingParams

    hidden = 128 if heads == 2 else 256
    d = build_tiny_model(tmp_path / "q35", arch="qwen3_5", num_layers=4, num_heads=heads,
                         hidden_size=hidden, embed_std=0.05)
    m = BaseModel(d, dtype="float32", device="cuda")
    # (fla's kernels were autotuned at load, on this model's head sizes: qwen35.warm)
    assert m.hybrid.warm() == (importlib.util.find_spec("fla") is not None)
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, m.vocab_size, (n,), generator=gen).tolist() for n in (70, 9, 150)]
    pk = Packing.of([len(r) for r in rows], "cuda")
    ids = torch.tensor([t for r in rows for t in r], device="cuda")[None]
    with torch.no_grad():
        fast = m.logits(m.forward(ids, pk.positions, packing=pk)).float().log_softmax(-1)
        m.hybrid.fla = False
        ref = m.logits(m.forward(ids, pk.positions, packing=pk)).float().log_softmax(-1)
        m.hybrid.fla = True
    assert (fast - ref).abs().max() < 2e-3
    prompts = [torch.randint(5, m.vocab_size, (n,), generator=gen).tolist() for n in (7, 90)]
    reqs = [SampleRequest(None, p, SamplingParams(max_tokens=8, temperature=0.0, stop=[]),
                          num_samples=2) for p in prompts]
    out = generate(m, reqs, [None, None], batch=RunningBatch(m, prefill_tokens=64))
    m.hybrid.fla = False  # the torch rule's decode steps, the reference
    ref = generate(m, reqs, [None, None], batch=RunningBatch(m, prefill_tokens=64))
    m.hybrid.fla = True
    for a, b in zip(out, ref, strict=True):
        for s, t in zip(a.sequences, b.sequences, strict=True):
            assert s.tokens == t.tokens
            assert max(abs(x - y) for x, y in zip(s.logprobs, t.logprobs, strict=True)) < 2e-3
    for p, r in zip(prompts, out, strict=True):
        want = m.hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=8,
                             do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):]
        assert [s.tokens for s in r.sequences] == [want.tolist()] * 2
