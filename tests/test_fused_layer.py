"""The fused decoder layer (fused_ops.py: RMSNorm, residual add + RMSNorm, rotary, SiLU * up,
one GEMM for q/k/v and for gate/up) against the reference path (BaseModel.fused =
Fused.off(): HF's modules op by op): every loss, a mixed batch of adapters, packed and
padded, with and without recompute, give the same logprobs, losses and gradients of every
adapter (fp32); seeded sampling gives the same tokens. The kernels are liger-kernel's
wherever it is installed: on CPU in Triton's interpreter (liger_interpret.py), on a GPU
with TWINKLE_TEST_DEVICE=cuda; without it, the levers' eager math (the fused structure:
split GEMM outputs, the add + norm order). The op tests check each kernel against the
reference math, values and gradients, fp32 and (on a GPU) bf16."""

from __future__ import annotations

import contextlib
import os
import zlib
from importlib.util import find_spec

import pytest
import torch
from helpers import DEVICE, all_close, assert_same_results, grads, loss_data, mixed_engine
from liger_interpret import kernels_here

from twinkled.engine import fused_ops
from twinkled.engine.fused_ops import Fused
from twinkled.engine.losses import LOSSES
from twinkled.protocol.types import ForwardBackwardRequest, SampleRequest, SamplingParams

# name -> (rank, train_attn, train_mlp, train_unembed); a and b share a bank
ADAPTERS = {"a": (4, True, True, True), "b": (4, True, True, True),
            "m": (8, False, True, False), "t": (2, True, False, True)}
# Whether liger's kernels run here, on a CPU decided without importing them (~2 CPU-s in
# every test process that collects this file): installed, and Triton's interpreter on.
# _liger() imports them (patching the interpreter) when a test takes them.
KERNELS = kernels_here(DEVICE) if DEVICE != "cpu" else (
    find_spec("liger_kernel") is not None and os.environ.get("TRITON_INTERPRET") == "1")
kernels = pytest.mark.skipif(not KERNELS, reason="liger-kernel is not installed")
cuda = pytest.mark.skipif(DEVICE != "cuda" or not KERNELS, reason="bf16 kernels: a GPU's")


ARCHS = ("qwen3", "qwen2", "llama")  # qwen3: q/k norms; qwen2: q/k/v biases; llama: neither


def _liger() -> None:
    """liger's kernels loaded (on a CPU, the interpreter's gaps filled): before a kernel
    runs."""
    assert kernels_here(DEVICE), "liger-kernel did not load"


@pytest.fixture(scope="module")
def engines(arch_dirs):
    made = {}

    def get(arch: str, kernels: bool):
        if kernels:
            _liger()
        if arch not in made:
            made[arch] = mixed_engine(arch_dirs[arch], ADAPTERS)
        made[arch].model.kernels = kernels
        return made[arch]
    return get


# The levers' eager math: every loss packed and padded on qwen3 (q/k norms: every lever);
# the other architectures (qwen2's q/k/v biases, llama's neither) with a supervised and an
# RL loss in each layout: a loss reads only the logprobs the layer makes.
EAGER_CASES = [("qwen3", loss, packed) for loss in LOSSES for packed in (True, False)] + [
    (arch, loss, packed) for arch in ARCHS[1:] for loss in ("cross_entropy", "ppo")
    for packed in (True, False)]


def _run(eng, requests, fused: Fused, forward_only: bool = False):
    eng.model.fused = fused
    for name in ADAPTERS:
        eng.zero_grad(name)
    try:
        results = (eng.forward if forward_only else eng.forward_backward)(requests)
    finally:
        eng.model.fused = Fused()
    return results, {name: grads(eng, name) for name in ADAPTERS}


# Each adapter's rows (tokens). The interpreter runs liger's kernels a program per row, so
# its cases take shorter rows (about a third fewer tokens, the time with them): still two
# rows for a and m, of different lengths, and each row longer than the 2 prompt tokens
# loss_data leaves out of the RL losses (else an adapter could get no gradient).
LENGTHS = ([9, 5], [7], [8, 3], [6])
LIGER_LENGTHS = ([5, 4], [6], [5, 3], [4])


def _requests(eng, loss: str, lengths=LENGTHS) -> list[ForwardBackwardRequest]:
    gen = torch.Generator().manual_seed(zlib.crc32(loss.encode()))
    return [ForwardBackwardRequest(name, loss_data(eng, gen, loss, name, n), loss)
            for name, n in zip(ADAPTERS, lengths, strict=True)]


def _assert_same(eng, requests, levers: Fused, tol: float = 1e-4):
    ref, ref_grads = _run(eng, requests, Fused.off())
    ours, our_grads = _run(eng, requests, levers)
    assert_same_results(ref, ours, tol=tol)
    for name in ADAPTERS:
        zero = [k for k, (a, b) in ref_grads[name].items() if not a.abs().sum() > 0]
        assert not zero, (name, zero)
        assert all_close(our_grads[name], ref_grads[name], rtol=1e-4, atol=1e-6), name


@contextlib.contextmanager
def _packed(eng, packed: bool):
    eng.packed = packed
    try:
        yield
    finally:
        eng.packed = True


@pytest.mark.parametrize("arch,loss,packed", EAGER_CASES)
def test_fused_layer_equals_the_reference(engines, arch, loss, packed):
    eng = engines(arch, False)
    with _packed(eng, packed):
        _assert_same(eng, _requests(eng, loss), Fused())


# liger's kernels: in the CPU interpreter a pass takes seconds, so a few cases of each kind
@kernels
# (each arch once: qwen3's q/k norms, qwen2's biases, llama; packed and padded; an RL loss and
# cross-entropy; recompute and forward-only below)
@pytest.mark.parametrize("arch,loss,packed", [
    ("qwen3", "ppo", False), ("qwen2", "importance_sampling", True),
    ("llama", "cross_entropy", False)])
def test_liger_layer_equals_the_reference(engines, arch, loss, packed):
    eng = engines(arch, True)
    with _packed(eng, packed):
        _assert_same(eng, _requests(eng, loss, LIGER_LENGTHS), Fused())


@kernels
@pytest.mark.parametrize("lever", ["norm", "rope", "silu", "gemm", "silu,gemm"])
def test_each_lever_alone_equals_the_reference(engines, lever):
    """silu,gemm: the SiLU kernel reading gate/up in place from the joint GEMM's output."""
    eng = engines("qwen3", True)
    _assert_same(eng, _requests(eng, "cross_entropy", LIGER_LENGTHS), Fused.parse(lever))


@pytest.mark.parametrize("liger", [False, pytest.param(True, marks=kernels)],
                         ids=["eager", "liger"])
def test_fused_layer_under_recompute_and_forward_only(engines, liger):
    eng = engines("qwen3", liger)
    requests = _requests(eng, "importance_sampling", LIGER_LENGTHS if liger else LENGTHS)
    eng.model.recompute.set_mode("on")
    used = eng.model.recompute.used
    try:
        _assert_same(eng, requests, Fused())
    finally:
        eng.model.recompute.set_mode("auto")
    assert eng.model.recompute.used > used  # the layers really ran again in the backward
    ref, _ = _run(eng, requests, Fused.off(), forward_only=True)
    ours, _ = _run(eng, requests, Fused(), forward_only=True)
    assert_same_results(ref, ours, tol=1e-4)


@pytest.mark.parametrize(("arch", "liger"), [
    ("qwen3", False), ("qwen2", False), pytest.param("qwen3", True, marks=kernels)],
    ids=["qwen3-eager", "qwen2-eager", "qwen3-liger"])  # liger's kernels are arch-blind
def test_seeded_samples_are_the_same_tokens(engines, arch, liger):
    eng = engines(arch, liger)
    gen = torch.Generator().manual_seed(3)
    reqs = [SampleRequest(name, torch.randint(5, eng.model.vocab_size, (n,), generator=gen)
                          .tolist(), SamplingParams(max_tokens=12, temperature=1.0, seed=7 + n,
                                                    stop=[]), num_samples=2)
            for name, n in (("a", 5), ("t", 9), (None, 3))]

    def sample(levers):
        eng.model.fused = levers
        try:
            return [[(s.tokens, s.logprobs) for s in r.sequences] for r in eng.sample(reqs)]
        finally:
            eng.model.fused = Fused()

    ref, ours = sample(Fused.off()), sample(Fused())
    for r, o in zip(ref, ours, strict=True):
        for (rt, rl), (ot, ol) in zip(r, o, strict=True):
            assert rt == ot
            assert torch.allclose(torch.tensor(rl), torch.tensor(ol), atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_joint_weights_are_the_modules_weights(engines, arch):
    """One tensor a group, the modules' weights views of it: no extra memory, and a module
    weight written in place is what the joint GEMM reads."""
    m = engines(arch, False).model
    for i, layer in enumerate(m.layers):
        attn, joint = layer.self_attn, m.joints[i]["attn"]
        parts = (attn.q_proj, attn.k_proj, attn.v_proj)
        base = joint.weight.untyped_storage().data_ptr()
        assert all(p.weight.untyped_storage().data_ptr() == base for p in parts)
        assert (joint.bias is None) == (attn.q_proj.bias is None)
        assert "mlp" in m.joints[i]
    w, joint = m.layers[0].self_attn.k_proj.weight, m.joints[0]["attn"]
    w[0, 0] += 1.0
    try:
        assert joint.weight[joint.sizes[0], 0] == w[0, 0]
    finally:
        w[0, 0] -= 1.0


def test_fused_parse_names_every_lever():
    assert Fused.parse("all") == Fused() and Fused.parse("none") == Fused.off()
    assert Fused.parse("rope,gemm") == Fused(norm=False, rope=True, silu=False, gemm=True,
                                             prep=False)
    assert Fused.parse("prep") == Fused(norm=False, rope=False, silu=False, gemm=False)
    with pytest.raises(ValueError, match="bogus"):
        Fused.parse("norm,bogus")


def test_the_fused_kernels_setting_is_checked_and_reaches_the_engine(tmp_path, tiny_dir):
    """`fused_kernels` (the operator's switch back to the reference layer) is checked at
    the door with the others, and the engine takes it."""
    from twinkled.engine.engine import Engine
    from twinkled.protocol.config import check_config

    for value, ok in (("none", True), ("norm,gemm", True), ("fast", False), ("", False)):
        path = tmp_path / "c.toml"
        path.write_text(f'fused_kernels = "{value}"\n')
        problems = check_config(path)
        assert (problems == []) == ok and all(p.startswith("fused_kernels:") for p in problems)
    assert Engine(tiny_dir, fused="none").model.fused == Fused.off()
    assert Engine(tiny_dir, fused="rope").model.fused == Fused.parse("rope")


def _grads_of(fn, inputs, seed):
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator(device=outs[0].device).manual_seed(seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=gen, device=o.device)).sum()
               for o in outs)
    loss.backward()
    return [o.detach().float() for o in outs] + [t.grad.float() for t in inputs
                                                  if t.grad is not None]


@kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_liger_kernels_equal_the_reference_ops(dtype):
    """Each kernel against the eager math it replaces, values and gradients."""
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("bf16 kernels: a GPU's")
    _liger()
    dev, gen = torch.device(DEVICE), torch.Generator(device=DEVICE).manual_seed(0)
    tol = 1e-5 if dtype == torch.float32 else 3e-2

    def r(*shape):
        return torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32).to(dtype)

    x, res, w = r(2, 37, 256), r(2, 37, 256), 1 + 0.1 * r(256)
    q, k = r(2, 8, 37, 64), r(2, 2, 37, 64)
    pos = torch.arange(37, device=dev)[None].expand(2, 37).float()
    freqs = pos[..., None] / (1e4 ** (torch.arange(0, 64, 2, device=dev) / 64))
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    gu = r(2, 37, 2 * 384)
    cases = {
        "rms_norm": (lambda k_, a, b: fused_ops.rms_norm(a, b, 1e-6, k_), (x, w)),
        "add_rms_norm": (lambda k_, a, b, c: fused_ops.add_rms_norm(a, b, c, 1e-6, k_),
                         (x, res, w)),
        "rope": (lambda k_, a, b: fused_ops.rope(a.clone(), b.clone(), cos, sin, k_), (q, k)),
        "silu_mul": (lambda k_, a, b: fused_ops.silu_mul(a, b, k_), (gu[..., :384], gu[..., 384:])),
        "silu_mul joint": (lambda k_, a: fused_ops.silu_mul(*a.split(384, -1), k_, a), (gu,)),
    }
    for name, (fn, inputs) in cases.items():
        want = _grads_of(lambda *a, fn=fn: fn(False, *a), inputs, 1)
        got = _grads_of(lambda *a, fn=fn: fn(True, *a), inputs, 1)
        for a, b in zip(want, got, strict=True):
            err = ((a - b).abs().max() / a.abs().max().clamp_min(1)).item()
            assert err < tol, (name, dtype, err)


@cuda
def test_bf16_logits_of_the_fused_layer_stay_near_the_reference(arch_dirs):
    from helpers import make_engine

    eng = make_engine(arch_dirs["qwen3"], dtype="bfloat16", device="cuda")
    ids = torch.randint(5, eng.model.vocab_size, (2, 40), generator=torch.Generator()
                        .manual_seed(1)).cuda()
    pos = torch.arange(40, device="cuda")[None].expand(2, 40)
    out = {}
    with torch.no_grad():
        for name, levers in (("ref", Fused.off()), ("fused", Fused())):
            eng.model.fused = levers
            out[name] = eng.model.logits(eng.model.forward(ids, pos)).float()
    eng.model.fused = Fused()
    diff = (out["ref"] - out["fused"]).abs().max().item()
    assert diff < 0.05 * out["ref"].abs().max().item(), diff
