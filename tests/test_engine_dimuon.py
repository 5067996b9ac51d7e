"""Dimuon, Tinker's second optimizer (`twinkled/engine/dimuon.py` has the rule and sources)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import adapter_snapshot, all_close, ce_request, make_engine, randomize_b, weights

from twinkled.protocol.types import AdamParams, DimuonParams, EngineInputError, LoraConfig

DIMUON = LoraConfig(rank=4, seed=0, optimizer="dimuon")


def _engine(tiny_dir, **adapters: LoraConfig):
    eng = make_engine(tiny_dir)
    for i, (name, config) in enumerate(adapters.items()):
        eng.add_adapter(name, config)
        randomize_b(eng, name, seed=10 + i)  # so lora_A gets gradients from the first step
    return eng


def _cpu(tensors) -> list[torch.Tensor]:
    return [t.detach().cpu().clone() for t in tensors]


def _newton_schulz_by_hand(u: torch.Tensor) -> torch.Tensor:
    """Muon's matrix sign, in float64: 5 steps of X <- aX + (bXX^T + c(XX^T)^2)X on the
    wide orientation, starting from X / |X|_F (torch.optim.Muon's constants)."""
    x = u.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / max(x.norm().item(), 1e-7)
    for _ in range(5):
        g = x @ x.T
        x = 3.4445 * x + (-4.7750 * g + 2.0315 * g @ g) @ x
    return x.T if tall else x


def test_update_is_the_documented_rule_by_hand(tiny_dir):
    eng = _engine(tiny_dir, d=DIMUON)
    a = eng.pool.get("d")
    w = [t.double() for t in _cpu(a.bank.tensors(a.slot, "w"))]
    m = [torch.zeros_like(t) for t in w]
    gen = torch.Generator().manual_seed(1)
    schedule = [DimuonParams(learning_rate=1e-2),
                DimuonParams(learning_rate=5e-3, beta1=0.5, grad_clip_norm=1e-3),
                DimuonParams(learning_rate=2e-2, beta1=0.0, rank_lr_correction_exponent=0.0)]
    for p in schedule:
        eng.forward_backward([ce_request("d", gen, eng.model.vocab_size, [10, 6])])
        g = [t.double() for t in _cpu(a.bank.tensors(a.slot, "g"))]
        norm = torch.cat([t.flatten() for t in g]).norm().item()
        if p.grad_clip_norm > 0 and norm > p.grad_clip_norm:
            g = [t * p.grad_clip_norm / (norm + 1e-6) for t in g]
        lr = p.learning_rate * (32 / 4) ** p.rank_lr_correction_exponent
        before = [t.clone() for t in w]
        for i in range(len(w)):
            m[i] = p.beta1 * m[i] + (1 - p.beta1) * g[i]
            w[i] = w[i] - lr * _newton_schulz_by_hand((1 - p.beta1) * g[i] + p.beta1 * m[i])
        res = eng.optim_step("d", p)
        assert res.applied and res.metrics["grad_norm:mean"] == pytest.approx(norm, rel=1e-5)
        ours = _cpu(a.bank.tensors(a.slot, "w"))
        assert all(torch.allclose(x.double(), y, atol=1e-6) for x, y in zip(ours, w, strict=True))
        state = _cpu(a.bank.tensors(a.slot, "m"))
        assert all(torch.allclose(x.double(), y, atol=1e-7) for x, y in zip(state, m, strict=True))
        # Tinker: the rate applies to a direction of Frobenius norm ~sqrt(rank) per matrix
        # (Newton-Schulz leaves singular values near 1, not exactly 1).
        for x, y in zip(before, w, strict=True):
            assert 0.6 * 2 < ((x - y) / lr).norm() < 1.2 * 2
        assert all(t.abs().max() == 0 for t in a.bank.tensors(a.slot, "g"))  # cleared
    assert eng.adapter_info("d").steps == 3 and eng.adapter_info("d").optimizer == "dimuon"


def test_the_same_step_as_torch_optim_muon(tiny_dir):
    """torch.optim.Muon (bfloat16 iteration) with its shape adjustment undone gives the
    same steps, to bfloat16's precision."""
    eng = _engine(tiny_dir, d=DIMUON)
    a = eng.pool.get("d")
    ref = [t.requires_grad_(True) for t in _cpu(a.bank.tensors(a.slot, "w"))]
    lr = 1e-2 * (32 / 4) ** 0.175
    # "original" scales each matrix's rate by sqrt(max(1, rows / cols)); Dimuon does not.
    groups = [{"params": [p], "lr": lr / max(1, p.shape[0] / p.shape[1]) ** 0.5} for p in ref]
    opt = torch.optim.Muon(groups, weight_decay=0.0, momentum=0.8, nesterov=True,
                           adjust_lr_fn="original")
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        eng.forward_backward([ce_request("d", gen, eng.model.vocab_size, [12])])
        for p, g in zip(ref, _cpu(a.bank.tensors(a.slot, "g")), strict=True):
            p.grad = g
        theirs, ours = [p.detach().clone() for p in ref], _cpu(a.bank.tensors(a.slot, "w"))
        opt.step()
        eng.optim_step("d", DimuonParams(learning_rate=1e-2, beta1=0.8))
        theirs = [p.detach() - b for p, b in zip(ref, theirs, strict=True)]
        ours = [w - b for w, b in zip(_cpu(a.bank.tensors(a.slot, "w")), ours, strict=True)]
        for x, y in zip(ours, theirs, strict=True):
            assert (x - y).norm() < 0.05 * y.norm()  # bfloat16 vs float32


def test_training_lowers_the_loss(tiny_dir):
    eng = _engine(tiny_dir, d=LoraConfig(rank=8, seed=3, optimizer="dimuon"))
    req = ce_request("d", torch.Generator().manual_seed(3), eng.model.vocab_size, [16, 16])
    losses = []
    for _ in range(12):
        losses.append(eng.forward_backward([req])[0].metrics["loss:sum"])
        assert eng.optim_step("d", DimuonParams(learning_rate=2e-2)).applied
    assert losses[-1] < 0.5 * losses[0]


STEP = DimuonParams(learning_rate=1e-2, beta1=0.7)


def _train(eng, name, steps, gen, params=STEP):
    for _ in range(steps):
        eng.forward_backward([ce_request(name, gen, eng.model.vocab_size, [9, 13])])
        assert eng.optim_step(name, params).applied


def test_checkpoint_resumes_exactly_and_keeps_the_family(tiny_dir, tmp_path):
    from safetensors import safe_open

    straight = _engine(tiny_dir, d=DIMUON)
    _train(straight, "d", 4, torch.Generator().manual_seed(4))

    first = _engine(tiny_dir, d=DIMUON)
    gen = torch.Generator().manual_seed(4)
    _train(first, "d", 2, gen)
    first.save("d", tmp_path / "ck", optimizer=True)
    with safe_open(tmp_path / "ck" / "optimizer.safetensors", "pt") as f:
        assert f.metadata()["optimizer"] == "dimuon"
        assert all(k.endswith(".momentum_buffer") for k in f.keys())
    assert json.loads((tmp_path / "ck" / "adapter_config.json").read_text())["r"] == 4

    fresh = make_engine(tiny_dir)  # a new process sees only the files
    info = fresh.load("resumed", tmp_path / "ck", optimizer=True)
    assert (info.optimizer, info.steps) == ("dimuon", 2)
    _train(fresh, "resumed", 2, gen)
    x, y = weights(straight, "d"), weights(fresh, "resumed")
    assert all(torch.equal(x[k][i], y[k][i]) for k in x for i in range(2))

    # Weights only: fresh state, and the family the caller asks for (AdamW by default).
    assert fresh.load("w", tmp_path / "ck", optimizer=False).optimizer == "adamw"
    info = fresh.load("w2", tmp_path / "ck", optimizer=False, optimizer_type="dimuon")
    assert (info.optimizer, info.steps) == ("dimuon", 0)
    w2 = fresh.pool.get("w2")
    assert all(t.abs().max() == 0 for t in w2.bank.tensors(w2.slot, "m"))


def test_optimizer_state_of_the_other_family_is_refused(tiny_dir, tmp_path):
    eng = _engine(tiny_dir, d=DIMUON, a=LoraConfig(rank=4, seed=1))
    _train(eng, "d", 1, torch.Generator().manual_seed(5))
    eng.save("d", tmp_path / "ck", optimizer=True)
    before = adapter_snapshot(eng, "a")
    with pytest.raises(EngineInputError, match="'dimuon' optimizer state"):
        eng.load("a", tmp_path / "ck", optimizer=True)
    after = adapter_snapshot(eng, "a")
    assert all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(EngineInputError, match="optimizer_config.type"):
        eng.load("new", tmp_path / "ck", optimizer=True, optimizer_type="adamw")
    assert not eng.has_adapter("new")


def test_live_state_resumes_exactly(tiny_dir, tmp_path):
    """The workers' write-behind state (as after a worker crash) keeps Dimuon's momentum."""
    from twinkled.workers.persist import Persister, latest_version

    straight = _engine(tiny_dir, d=DIMUON)
    _train(straight, "d", 3, torch.Generator().manual_seed(6))
    first = _engine(tiny_dir, d=DIMUON)
    gen = torch.Generator().manual_seed(6)
    _train(first, "d", 2, gen)
    persister = Persister(tmp_path / "live")
    persister.mark("d")
    assert persister.flush(first.pool.adapters, {})

    fresh = make_engine(tiny_dir)
    info = fresh.load("d", latest_version(tmp_path / "live", "d"), optimizer=True)
    assert (info.optimizer, info.steps) == ("dimuon", 2)
    _train(fresh, "d", 1, gen)
    x, y = weights(straight, "d"), weights(fresh, "d")
    assert all(torch.equal(x[k][i], y[k][i]) for k in x for i in range(2))


def test_a_mixed_step_equals_each_adapter_alone(tiny_dir):
    """AdamW and Dimuon adapters (two ranks) stepping in one call, after one shared pass,
    end where each ends trained alone."""
    configs = {"a": LoraConfig(rank=4, seed=1), "d": DIMUON,
               "e": LoraConfig(rank=8, seed=2, optimizer="dimuon")}
    params = {"a": AdamParams(learning_rate=1e-2), "d": DimuonParams(learning_rate=1e-2),
              "e": DimuonParams(learning_rate=3e-3, beta1=0.5, grad_clip_norm=0.1)}
    together = _engine(tiny_dir, **configs)
    alone = {n: _engine(tiny_dir, **{n: c}) for n, c in configs.items()}
    for n, e in alone.items():  # the same initial B as in `together`
        randomize_b(e, n, seed=10 + list(configs).index(n))
    for step in range(2):
        reqs = {n: ce_request(n, torch.Generator().manual_seed(7 + step),
                              together.model.vocab_size, [9]) for n in configs}
        together.forward_backward(list(reqs.values()))
        results = together.optim_steps(list(params.items()))
        for (n, e), r in zip(alone.items(), results, strict=True):
            e.forward_backward([reqs[n]])
            own = e.optim_step(n, params[n])
            assert r.applied and r.metrics["grad_norm:mean"] == pytest.approx(
                own.metrics["grad_norm:mean"], rel=1e-4)
    for n, e in alone.items():
        assert all_close(weights(together, n), weights(e, n), rtol=1e-4, atol=1e-6)


def test_params_of_the_other_family_are_refused_and_change_nothing(tiny_dir):
    eng = _engine(tiny_dir, d=DIMUON, a=LoraConfig(rank=4, seed=1))
    gen = torch.Generator().manual_seed(8)
    eng.forward_backward([ce_request(n, gen, eng.model.vocab_size, [8]) for n in "da"])
    before = {n: adapter_snapshot(eng, n) for n in "da"}
    with pytest.raises(EngineInputError, match="adam_params: .*'dimuon'"):
        eng.optim_step("d", AdamParams())
    with pytest.raises(EngineInputError, match="optimizer_params: .*'adamw'"):
        eng.optim_step("a", DimuonParams(learning_rate=1e-2))
    with pytest.raises(EngineInputError, match="adam_params"):  # one bad item: none step
        eng.optim_steps([("a", AdamParams()), ("d", AdamParams())])
    for n in "da":
        after = adapter_snapshot(eng, n)
        assert all(torch.equal(before[n][k], after[k]) for k in after)
        assert eng.pool.get(n).pending == 1


@pytest.mark.parametrize(("bad", "field"), [
    (DimuonParams(learning_rate=float("nan")), "learning_rate"),
    (DimuonParams(learning_rate=-1e-3), "learning_rate"),
    (DimuonParams(learning_rate=1e-2, beta1=1.0), "beta1"),
    (DimuonParams(learning_rate=1e-2, beta1=-0.1), "beta1"),
    (DimuonParams(learning_rate=1e-2, grad_clip_norm=float("inf")), "grad_clip_norm"),
    (DimuonParams(learning_rate=1e-2, rank_lr_correction_exponent=float("nan")),
     "rank_lr_correction_exponent"),
    (DimuonParams(learning_rate=True), "learning_rate"),
])
def test_bad_dimuon_params_are_refused_naming_the_field(tiny_dir, bad, field):
    eng = _engine(tiny_dir, d=DIMUON)
    eng.forward_backward([ce_request("d", torch.Generator().manual_seed(9),
                                     eng.model.vocab_size, [8])])
    with pytest.raises(EngineInputError, match=f"optimizer_params.{field}"):
        eng.optim_step("d", bad)
    assert eng.pool.get("d").pending == 1


def test_nonpositive_grad_clip_norm_means_no_clipping(tiny_dir):
    """The SDK's words: "Nonpositive values disable gradient clipping"."""
    ends = []
    for clip in (0.0, -1.0):
        eng = _engine(tiny_dir, d=DIMUON)
        _train(eng, "d", 2, torch.Generator().manual_seed(10),
               DimuonParams(learning_rate=1e-2, grad_clip_norm=clip))
        ends.append(weights(eng, "d"))
    assert all(torch.equal(ends[0][k][i], ends[1][k][i]) for k in ends[0] for i in range(2))


def test_an_unknown_optimizer_is_refused(tiny_dir):
    eng = make_engine(tiny_dir)
    with pytest.raises(EngineInputError, match="optimizer_config.type: unknown optimizer 'sgd'"):
        eng.add_adapter("x", LoraConfig(rank=4, optimizer="sgd"))
    assert not eng.has_adapter("x")
