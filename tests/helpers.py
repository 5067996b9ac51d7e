"""Small builders shared by the engine tests."""

from __future__ import annotations

import importlib
import os
import types
from importlib.util import find_spec

import pytest
import torch

from twinkled.engine.engine import Engine
from twinkled.protocol.types import Datum, ForwardBackwardRequest, LoraConfig

# The engine tests run on the CPU in CI; TWINKLE_TEST_DEVICE=cuda runs them on a GPU.
DEVICE = os.environ.get("TWINKLE_TEST_DEVICE", "cpu")


class _Deferred(types.ModuleType):
    """A module imported at its first attribute (not at pytest's probes of a test module's
    names for dunders such as `__test__`)."""

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return getattr(importlib.import_module(self.__name__), attr)


def importorskip_deferred(name: str, package: str | None = None) -> types.ModuleType:
    """`pytest.importorskip(name)` at a test module's top, without the import: the module
    skips when `package` (default: `name`'s top-level package) is not installed, and `name`
    is imported when a test first uses it. Every test process of `make test` imports every
    test file, and only the one that runs a file's tests needs its SDK (measured, CPU on top
    of torch and tinker: anthropic 2.3 s, openai 0.8 s, moto's server 0.5 s)."""
    package = package or name.partition(".")[0]
    if find_spec(package) is None:
        pytest.skip(f"could not import {package!r}", allow_module_level=True)
    return _Deferred(name)


def make_engine(model_dir, **kw) -> Engine:
    kw.setdefault("device", DEVICE)
    return Engine(model_dir, **kw)


def random_datum(gen: torch.Generator, n: int, vocab: int, **extra) -> Datum:
    """A datum of n input tokens; targets are the next tokens of a random sequence."""
    seq = torch.randint(0, vocab, (n + 1,), generator=gen)
    inputs = {"target_tokens": seq[1:]}
    inputs.update(extra)
    return Datum(seq[:-1], inputs)


def rl_datum(gen: torch.Generator, n: int, vocab: int) -> Datum:
    return random_datum(gen, n, vocab, logprobs=-torch.rand(n, generator=gen) * 3,
                        advantages=torch.randn(n, generator=gen))


def centre_on_model(engine, adapter_id: str, data: list[Datum], gen: torch.Generator,
                    spread: float = 0.5) -> None:
    """Put each RL datum's sampler logprobs near the model's own (lp + N(0, spread)), so the
    ratios exp(lp - q) land on both sides of 1 and of a clip range like [0.8, 1.2]:
    rl_datum's q in [-3, 0] sits far above a tiny model's lp (about -7), all ratios << 0.8."""
    fwd = engine.forward([ForwardBackwardRequest(adapter_id, data)])[0]
    for d, out in zip(data, fwd.outputs, strict=True):
        lp = out["logprobs"].cpu()
        d.loss_inputs["logprobs"] = lp + torch.randn(lp.shape, generator=gen) * spread


def ce_request(adapter, gen, vocab, lengths, **kw) -> ForwardBackwardRequest:
    return ForwardBackwardRequest(adapter, [random_datum(gen, n, vocab) for n in lengths], **kw)


def adapter_snapshot(engine, adapter_id: str) -> dict[str, torch.Tensor]:
    """Copies of an adapter's weights, gradients and AdamW moments."""
    a = engine.pool.get(adapter_id)
    out = {}
    for kind in ("w", "g", "m", "v"):
        for i, t in enumerate(a.bank.tensors(a.slot, kind)):
            out[f"{kind}{i}"] = t.detach().cpu().clone()
    return out


def grads(engine, adapter_id: str) -> dict[str, torch.Tensor]:
    a = engine.pool.get(adapter_id)
    return {k: (a.bank.gA[k][a.slot].cpu().clone(), a.bank.gB[k][a.slot].cpu().clone())
            for k in a.bank.shapes}


def weights(engine, adapter_id: str) -> dict[str, torch.Tensor]:
    a = engine.pool.get(adapter_id)
    return {k: (a.bank.A[k][a.slot].cpu().clone(), a.bank.B[k][a.slot].cpu().clone())
            for k in a.bank.shapes}


def rel_diff(a, b) -> float:
    """Largest |a - b| relative to b's largest magnitude (tensors, lists or numbers)."""
    a, b = torch.as_tensor(a).float(), torch.as_tensor(b).float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def max_diff(x: dict, y: dict) -> float:
    assert x.keys() == y.keys()
    return max(max((a - b).abs().max().item() for a, b in zip(x[k], y[k], strict=True)) for k in x)


@torch.no_grad()
def randomize_b(engine, adapter_id: str, seed: int, std: float = 0.05) -> None:
    """Give lora_B non-zero values (it starts at zero, which would hide A's gradients)."""
    a = engine.pool.get(adapter_id)
    gen = torch.Generator().manual_seed(seed)
    for k in a.bank.shapes:
        b = a.bank.B[k][a.slot]
        b.copy_(torch.randn(b.shape, generator=gen).to(b.device) * std)
    a.bank.changed(a.slot)  # (its sampling copies and cached KV follow)


def all_close(x: dict, y: dict, rtol: float = 1e-5, atol: float = 1e-5) -> bool:
    """Equal up to float rounding where summation order differs (e.g. accumulation):
    each tensor's worst difference is small next to that tensor's largest value."""
    assert x.keys() == y.keys()
    return all((a - b).abs().max() <= atol + rtol * b.abs().max()
               for k in x for a, b in zip(x[k], y[k], strict=True))


def assert_same_results(want: list, got: list, tol: float = 1e-5) -> None:
    """Two runs' ForwardBackwardResults: loss sums, logprobs and elementwise losses agree."""
    import pytest

    for w, g in zip(want, got, strict=True):
        # A sum's rounding follows the size of what it adds, not of the result: a PPO loss
        # of 2.1 differed by 3e-5 between the chunked and whole-logits heads on one CPU
        # (fp32 order of operations), where CI's agreed to 1e-5.
        size = sum(float(o["elementwise_loss"].abs().sum()) for o in w.outputs
                   if "elementwise_loss" in o)
        assert g.metrics["loss:sum"] == pytest.approx(w.metrics["loss:sum"], rel=tol,
                                                      abs=tol * max(1.0, size))
        for wo, go in zip(w.outputs, g.outputs, strict=True):
            for key in ("logprobs", "elementwise_loss"):
                assert wo[key].shape == go[key].shape
                assert torch.allclose(wo[key], go[key], rtol=tol, atol=tol), key


def assert_same_samples(ref: list, got: list, tol: float = 1e-4) -> None:
    """Two sampling runs' SampleResults: the same tokens, logprobs within `tol`; and the
    reference's logprobs not all near 0, so that the comparison means something."""
    import pytest

    assert min(lp for r in ref for s in r.sequences for lp in s.logprobs) < -0.1
    for r, g in zip(ref, got, strict=True):
        for x, y in zip(r.sequences, g.sequences, strict=True):
            assert x.tokens == y.tokens
            assert y.logprobs == pytest.approx(x.logprobs, abs=tol)


def assert_bf16_runs_agree(engines: list, want: list, got: list, adapters) -> None:
    """Two engines' ForwardBackwardResults and gradients in bf16, run two ways (packed and
    padded, shared and not): equal to bf16's noise (loss sums 2%, logprobs 0.05 nats a
    token on average, each gradient 5% of its norm)."""
    import pytest

    for w, g in zip(want, got, strict=True):
        assert w.metrics["loss:sum"] == pytest.approx(g.metrics["loss:sum"], rel=2e-2)
        for wo, go in zip(w.outputs, g.outputs, strict=True):
            assert (wo["logprobs"].float() - go["logprobs"].float()).abs().mean() < 0.05
    for name in adapters:
        for key, (ga, gb) in grads(engines[0], name).items():
            pa, pb = grads(engines[1], name)[key]
            for x, y in ((ga, pa), (gb, pb)):
                assert (x - y).norm() <= 0.05 * x.norm() + 1e-6, (name, key)


def one_adapter_engine(model_dir) -> Engine:
    """An engine with adapter "a" (rank 4, its B made non-zero so it changes outputs)."""
    e = make_engine(model_dir)
    e.add_adapter("a", LoraConfig(rank=4, alpha=16, seed=0))
    randomize_b(e, "a", seed=3, std=0.3)
    return e


def loss_data(eng, gen, loss: str, name: str, lengths: list[int]) -> list[Datum]:
    """Data of `lengths` tokens with every input `loss` takes (random, the sampler's
    logprobs near the model's so ratios fall on both sides of the clip ranges); adapter
    "a"'s cross_entropy data end with a top-K datum (K = 3 ids a position)."""
    vocab = eng.model.vocab_size
    data = [random_datum(gen, n, vocab) for n in lengths]
    for d in data:
        n = len(d.tokens)
        sampled = (torch.arange(n) >= 2).float()
        inp = d.loss_inputs
        if loss == "cross_entropy":
            inp["weights"] = torch.rand(n, generator=gen)
            continue
        inp["advantages"] = torch.randn(n, generator=gen) * sampled  # none on the prompt
        inp["logprobs"] = torch.zeros(n)
        if loss == "gspo":
            inp["sequence_ratio_mask"] = sampled
        if loss == "stable_reinforce":
            inp["sampled_mask"] = sampled
    if loss != "cross_entropy":  # ratios near 1: both sides of the clip ranges
        centre_on_model(eng, name, data, gen, spread=0.3)
        for d in data:
            d.loss_inputs["sampler_logprobs"] = d.loss_inputs["logprobs"]
            if loss != "stable_reinforce":
                del d.loss_inputs["sampler_logprobs"]
    if loss == "cross_entropy" and name == "a":  # top-K distillation: K ids per position
        n = lengths[0]
        data.append(Datum(data[0].tokens, {
            "target_tokens": torch.randint(0, vocab, (n, 3), generator=gen),
            "weights": torch.rand(n, 3, generator=gen)}))
    return data


def two_adapter_engine(model_dir, **kw) -> Engine:
    """An engine with adapters "a" and "b" (rank 4, alpha 8, seeds 0 and 1), B random
    (std 0.1) so that each changes the model's output; `kw` for the Engine."""
    e = make_engine(model_dir, **kw)
    for seed, name in enumerate(("a", "b")):
        e.add_adapter(name, LoraConfig(rank=4, alpha=8, seed=seed))
        randomize_b(e, name, seed=seed + 10, std=0.1)
    return e


def mixed_engine(model_dir, adapters: dict[str, tuple[int, bool, bool, bool]],
                 **kw) -> Engine:
    """An engine with `adapters`: name -> (rank, train_attn, train_mlp, train_unembed),
    alpha 2 x rank, B random (so every A has a gradient); `kw` for the Engine."""
    e = make_engine(model_dir, **kw)
    for seed, (name, (rank, attn, mlp, unembed)) in enumerate(adapters.items()):
        e.add_adapter(name, LoraConfig(rank=rank, alpha=2 * rank, seed=seed, train_attn=attn,
                                       train_mlp=mlp, train_unembed=unembed))
        randomize_b(e, name, seed=seed + 10)
    return e


def assert_export_round_trip(eng, model_dir, adapter: str, path) -> None:
    """`adapter`'s export (saved at `path`) loads in peft on transformers' own model with our
    logits (fp32), and loads back into the engine with them; the adapter changes them."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from twinkled.engine.lora import LoraBatch

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.randint(0, eng.model.vocab_size, (1, 20), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(20)[None]
    eng.load(adapter + "2", path, optimizer=False)
    m = eng.model
    with torch.no_grad():
        want = PeftModel.from_pretrained(base, path)(input_ids=ids).logits
        for name in (adapter, adapter + "2"):
            lora = LoraBatch([eng.pool.get(name)], m.dtype, m.device)
            got = m.logits(m.forward(ids, pos, lora), lora)
            assert (got - want).abs().max() < 1e-4, name
        assert (m.logits(m.forward(ids, pos)) - want).abs().max() > 1e-2  # the adapter matters
    eng.remove_adapter(adapter + "2")


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """transformers' (or peft's) own forward: each next token's logprob [n - 1]."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def assert_packed_logprobs_equal_hf(m) -> None:
    """BaseModel `m`'s forward (no adapter) against its transformers model on three rows
    packed end to end (fp32, 1e-4): a row's state never leaks into the next."""
    from twinkled.engine.packed import Packing

    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, m.vocab_size, (n,), generator=gen).tolist() for n in (70, 9, 33)]
    want = torch.cat([hf_logprobs(m.hf, r) for r in rows])
    pk = Packing.of([len(r) for r in rows], m.device)
    ids = torch.tensor([t for r in rows for t in r])
    with torch.no_grad():
        lp = m.logits(m.forward(ids[None], pk.positions, packing=pk))[0].float().log_softmax(-1)
    got = torch.cat([lp[s:s + len(r) - 1].gather(1, torch.tensor(r[1:])[:, None])[:, 0]
                     for s, r in zip((0, 70, 79), rows, strict=True)])
    assert (got - want).abs().max() < 1e-4


def delta_rule_inputs(lengths: list[int], Hk: int = 2, Hv: int = 4, dk: int = 64, dv: int = 32,
                      seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Random gated delta-rule inputs (engine/linear_attn.py's shapes) for rows of `lengths`,
    padding beyond each row's length neither decaying nor writing: ([q, k, v, gate, beta,
    initial state], the real positions' mask [N, L, 1])."""
    from twinkled.engine import linear_attn as la

    g = torch.Generator().manual_seed(seed)
    N, L = len(lengths), max(lengths)
    q, k = (torch.randn(N, L, Hk, dk, generator=g) for _ in range(2))
    v = torch.randn(N, L, Hv, dv, generator=g)
    real = la.valid(lengths, L, "cpu")[..., None]
    gate = -torch.rand(N, L, Hv, generator=g) * 0.5 * real
    beta = torch.rand(N, L, Hv, generator=g) * real
    s0 = torch.randn(N, Hv, dk, dv, generator=g) * 0.1
    return [q, k, v, gate, beta, s0], real


# -- the tinker client against a daemon (tests/test_workers.py, tests/test_worker_pair.py) ----
TINKER_T = 120  # seconds any one call may take


def tinker_datums(tok, texts: list[str]) -> list:
    """One next-token cross-entropy datum per text."""
    import tinker

    out = []
    for text in texts:
        ids = tok(text).input_ids
        out.append(tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
                                      loss_fn_inputs={"target_tokens": ids[1:]}))
    return out


def tinker_step(tc, data: list, lr: float = 1e-2):
    """A forward_backward and its optim_step; the forward_backward's output."""
    import tinker

    out = tc.forward_backward(data, "cross_entropy").result(timeout=TINKER_T)
    tc.optim_step(tinker.types.AdamParams(learning_rate=lr)).result(timeout=TINKER_T)
    return out


def tinker_logprobs(tc, data: list) -> list[list[float]]:
    """Each datum's target logprobs, from a forward."""
    out = tc.forward(data, "cross_entropy").result(timeout=TINKER_T)
    return [o["logprobs"].tolist() for o in out.loss_fn_outputs]


def lora_client(d, tenant: str, model_dir, seed: int):
    """A rank-4 LoRA training client of `tenant` (a key in `d.keys`) on daemon `d`, which
    serves the model of `model_dir`."""
    import tinker

    sc = tinker.ServiceClient(base_url=d.url, api_key=d.keys[tenant])
    return sc.create_lora_training_client(base_model=model_dir.name, rank=4,
                                          seed=seed).result(timeout=TINKER_T)


def checkpoint_tensors(data_dir, path: str) -> dict:
    """A saved checkpoint's tensors (weights and optimizer moments), by name."""
    from safetensors.torch import load_file

    from twinkled.store import Store

    store = Store(data_dir / "twinkle.db")
    directory = store.checkpoints.get(path)["dir"]
    store.close()
    tensors = {}
    for name in ("adapter_model.safetensors", "optimizer.safetensors"):
        tensors.update({f"{name}:{k}": v for k, v in load_file(f"{directory}/{name}").items()})
    return tensors


def hold_workers(tc, data):
    """A forward that holds the workers (TWINKLED_TEST_STEP_DELAY): what is sent while it
    runs shares the next step."""
    import time

    slow = tc.forward(data, "cross_entropy")
    time.sleep(0.1)
    return slow
