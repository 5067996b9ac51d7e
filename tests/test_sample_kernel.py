"""The fused sampling kernel (engine/kernels/sample_rows.py) in Triton's interpreter (conftest
sets TRITON_INTERPRET=1): against a float64 inverse-CDF reference given the same uniforms,
greedy rows' argmax, token frequencies, and RowChoice.pick against RowChoice.choose (the
same logprobs for the chosen tokens; a seed's tokens whatever rows sit beside it)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from helpers import DEVICE  # noqa: E402

from twinkled.engine import choose as choose_mod  # noqa: E402
from twinkled.engine.choose import RowChoice  # noqa: E402
from twinkled.engine.kernels import sample_rows  # noqa: E402
from twinkled.protocol.types import SamplingParams  # noqa: E402

CPU = torch.device("cpu")
# The tests below that run the kernel on CPU tensors need Triton's interpreter (CI); with it
# off (gpu_pass.sh gpucheck, TWINKLE_TEST_DEVICE=cuda) the kernel's own tests run compiled on
# the card instead (`_sample`).
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="Triton's interpreter on a CPU")


def _sample(logits, temp, u, **kw):
    """The kernel on the tests' device (TWINKLE_TEST_DEVICE=cuda: compiled, as gpu_pass.sh
    gpucheck runs it), its answers on the CPU."""
    dev = torch.device(DEVICE)
    tokens, lps = sample_rows.sample(logits.to(dev), temp.to(dev), u.to(dev), **kw)
    return tokens.cpu(), lps.cpu()


def _reference(logits: torch.Tensor, temp: torch.Tensor, u: torch.Tensor):
    """float64: each row's token (the first whose CDF exceeds u; greedy rows, T == 0 or
    u < 0, the first argmax), the log_softmax at its temperature (1 for greedy rows), and
    u's distance from the row's nearest CDF boundary."""
    x, t = logits.double(), temp.double()
    logp = torch.log_softmax(x / torch.where(t > 0, t, 1.0)[:, None], -1)
    cdf = logp.exp().cumsum(-1)
    cdf = cdf / cdf[:, -1:]
    drawn = torch.searchsorted(cdf, u.double()[:, None], right=True)[:, 0]
    drawn = drawn.clamp(max=x.shape[1] - 1)
    tokens = torch.where((t == 0) | (u < 0), x.argmax(-1), drawn)
    return tokens, logp, (cdf - u.double()[:, None]).abs().min(-1).values


def _logits(rows: int, vocab: int, seed: int, dtype: torch.dtype, pad: int = 37) -> torch.Tensor:
    """Rows of a wider buffer (row stride vocab + pad): some flat, some peaked."""
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randn((rows, vocab + pad), generator=gen) * 3
    buf[::3, :vocab] += torch.randn((1, vocab), generator=gen) * 6  # a few dominant tokens
    return buf.to(dtype)[:, :vocab]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tile", [1, 8])
def test_the_kernel_draws_the_reference_inverse_cdf_token(dtype, tile, monkeypatch):
    """12 rows of 5,000 (5 blocks of 1,024, the last partial), a row stride not the width,
    temperatures 0, 1 and others; one row a program (the GPU's) and 8 (the last program
    half empty): the reference token for each u, and its log_softmax within 1e-5 (bf16
    logits upcast exactly, so the reference from the same values is as tight)."""
    monkeypatch.setattr(sample_rows, "ROWS", tile)
    logits = _logits(12, 5000, 0, dtype)
    assert logits.stride(0) == 5037 and not logits.is_contiguous()
    temp = torch.tensor([1, 0, 0.7, 1.5, 1, 0.3, 2.0, 0, 1, 0.9, 1, 1], dtype=torch.float32)
    u = torch.rand(12, generator=torch.Generator().manual_seed(1))
    u[10] = -1.0  # a row in no group: the argmax
    tokens, lps = _sample(logits, temp, u, block=1024)
    want, logp, margin = _reference(logits, temp, u)
    clear = margin > 1e-6  # (u on a CDF boundary: either side is right)
    assert clear.sum() >= 11
    assert torch.equal(tokens[clear], want[clear]), (tokens, want)
    assert tokens.dtype == torch.int64 and lps.dtype == torch.float32
    got = logp.gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(lps.double(), got, rtol=0, atol=1e-5)
    assert len(set(tokens.tolist())) > 8  # not one token everywhere


def test_greedy_rows_take_the_first_argmax():
    """T == 0: the first index of the row's max (as torch.argmax), ties within a block and
    across blocks; its logprob is the unscaled log_softmax there."""
    logits = _logits(4, 3000, 2, torch.float32, pad=0).contiguous()
    top = logits.max() + 1
    logits[0, [7, 9]] = top  # a tie within the first block
    logits[1, [2900, 300, 1500]] = top  # across blocks: 300 first
    logits[2, 2999] = top  # the last entry alone
    logits[3, :] = 0.0  # all alike: token 0
    temp = torch.zeros(4)
    tokens, lps = _sample(logits, temp, torch.rand(4), block=1024)
    assert tokens.tolist() == [7, 300, 2999, 0] == logits.argmax(-1).tolist()
    want = torch.log_softmax(logits.double(), -1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(lps.double(), want, rtol=0, atol=1e-5)


def test_a_draw_never_takes_a_token_of_probability_zero():
    """Rows whose first and last tokens are -inf: u = 0 takes the first finite token, u = 1
    (past the draws' range: where rounding leaves the running sum short of u * total) the
    last one, never a -inf token."""
    logits = _logits(2, 3000, 3, torch.float32, pad=0).contiguous()
    logits[:, :40] = float("-inf")
    logits[:, 2100:] = float("-inf")
    tokens, lps = _sample(logits, torch.tensor([1.0, 0.6]), torch.tensor([0.0, 1.0]),
                          block=1024)
    assert tokens.tolist() == [40, 2099]
    want = torch.log_softmax(logits.double() / torch.tensor([[1.0], [0.6]]).double(), -1)
    torch.testing.assert_close(lps.double(), want.gather(1, tokens[:, None])[:, 0], rtol=0,
                               atol=1e-5)


@interpreted
def test_token_frequencies_follow_the_distribution(monkeypatch):
    """Through RowChoice.pick (each request's uniforms from its generator): 20,000 rows at
    T = 1 draw each token with its probability, 20,000 at T = 0.5 with p^2 renormalised
    (many rows a program: the interpreter's cost is by program)."""
    monkeypatch.setattr(sample_rows, "ROWS", 8192)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20000
    params = [SamplingParams(seed=9)] * n + [SamplingParams(temperature=0.5, seed=10)] * n
    gens = [torch.Generator().manual_seed(s) for s in (9, 10)]
    choice = RowChoice.of(params, [(list(range(n)), gens[0]), (list(range(n, 2 * n)), gens[1])],
                          CPU)
    tokens, lps = choice.pick(probs.log().expand(2 * n, 4).contiguous(), fused=True)
    sharp = probs ** 2 / (probs ** 2).sum()
    for got, want in ((tokens[:n], probs), (tokens[n:], sharp)):
        freq = torch.bincount(got, minlength=4).float() / n
        assert torch.allclose(freq, want, atol=0.015), (freq, want)  # sd <= 0.0036
    torch.testing.assert_close(lps[:n], probs.log()[tokens[:n]], rtol=0, atol=1e-6)
    torch.testing.assert_close(lps[n:], sharp.log()[tokens[n:]], rtol=0, atol=1e-6)


def _params():
    """Seeded, greedy, another temperature, unseeded: what a decode batch mixes."""
    return [SamplingParams(seed=3), SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.7, seed=4), SamplingParams(seed=3),
            SamplingParams(), SamplingParams(temperature=0.7, seed=4), SamplingParams(seed=3)]


@interpreted
def test_pick_gives_the_reference_logprob_of_its_token():
    """The fused pick's logprob is what choose's distribution says of the same token; the
    greedy row (1) and a row at T = 0.8 in no group (7: choose's noise there is 1) pick
    choose's tokens, their argmax."""
    logits = _logits(8, 3000, 5, torch.float32)
    groups = [[0, 3, 6], [2, 5], [4]]

    def choice():
        gens = [torch.Generator().manual_seed(s) for s in (3, 4)] + [None]
        return RowChoice.of(_params() + [SamplingParams(temperature=0.8)],
                            list(zip(groups, gens, strict=True)), CPU)

    tokens, lps = choice().pick(logits, fused=True)
    ref_tokens, ref_lps, logp = choice().choose(logits)
    torch.testing.assert_close(lps, logp.gather(1, tokens[:, None])[:, 0], rtol=0, atol=1e-5)
    for b in (1, 7):
        assert tokens[b] == ref_tokens[b] == logits[b].argmax()
        assert lps[b].item() == pytest.approx(ref_lps[b].item(), abs=1e-5)


@interpreted
def test_a_seeds_tokens_do_not_depend_on_their_neighbours():
    """Request A (seed 3, 3 samples) alone in slots 0..2, then scattered among other
    requests' rows (slots 1, 4, 6, as an index), then consecutive after others (a slice):
    the fused pick gives A's samples the same tokens and logprobs each time; its uniforms
    are torch.rand(3) from its own generator."""
    logits = _logits(3, 3000, 6, torch.float32)
    others = _logits(4, 3000, 7, torch.float32)
    a, b = SamplingParams(seed=3), SamplingParams(temperature=0.7, seed=4)
    cold, free = SamplingParams(temperature=0.0), SamplingParams()

    def run(params, rows, groups_b):
        gen = torch.Generator().manual_seed(3)
        groups = [(rows, gen), (groups_b, torch.Generator().manual_seed(4)), ([], None)]
        full = torch.empty((len(params), 3000))
        full[rows] = logits
        full[[i for i in range(len(params)) if i not in rows]] = others[:len(params) - 3]
        choice = RowChoice.of(params, groups, CPU)
        tokens, lps = choice.pick(full, fused=True)
        return tokens[rows], lps[rows]

    alone = run([a] * 3, [0, 1, 2], [])
    u = RowChoice.of([a] * 3, [([0, 1, 2], torch.Generator().manual_seed(3))], CPU).uniforms(3)
    assert torch.equal(u, torch.rand(3, generator=torch.Generator().manual_seed(3)))
    scattered = run([b, a, cold, free, a, b, a], [1, 4, 6], [0, 5])
    after = run([b, cold, free, a, a, a], [3, 4, 5], [0])
    for got in (scattered, after):
        assert torch.equal(got[0], alone[0]) and torch.equal(got[1], alone[1])
    assert len(set(alone[0].tolist())) > 1


@interpreted
def test_a_top_k_or_top_logprobs_neighbour_changes_no_requests_draw():
    """Request A (seed 3, 3 samples, the kernel's) beside B (seed 4, top-k 5, `choose`'s) and
    a greedy row: A's tokens are those it gets alone, B's those it gets alone, whichever
    rows sit between them; asking for top logprobs (select with k) changes no token, and
    its distribution is choose's. (Before: one top-k row sent the whole batch to `choose`,
    so a seed's tokens followed its neighbours.)"""
    logits = _logits(6, 2000, 8, torch.float32)
    a, b, cold = SamplingParams(seed=3), SamplingParams(seed=4, top_k=5), SamplingParams(
        temperature=0.0)

    def choice(params, groups):
        seeds = {id(a): 3, id(b): 4}
        return RowChoice.of(params, [(rows, torch.Generator().manual_seed(seeds[id(p)]))
                                     for rows, p in groups], CPU)

    def alone(p, n, rows):
        return choice([p] * n, [(list(range(n)), p)]).pick(logits[rows], fused=True)

    a_alone, b_alone = alone(a, 3, [0, 2, 5]), alone(b, 2, [1, 4])
    def mixed():  # (fresh generators each time)
        return choice([a, b, a, cold, b, a], [([0, 2, 5], a), ([1, 4], b)])

    plain, with_top = mixed().select(logits, 0, fused=True), mixed().select(logits, 2, fused=True)
    for tokens, lps, _ in (plain, with_top):
        for rows, want in (([0, 2, 5], a_alone), ([1, 4], b_alone)):
            assert torch.equal(tokens[rows], want[0])
            torch.testing.assert_close(lps[rows], want[1], rtol=0, atol=1e-5)
        assert tokens[3] == logits[3].argmax()
    assert plain[2] is None and torch.equal(with_top[2], mixed().choose(logits)[2])
    b_ref = choice([b] * 2, [([0, 1], b)]).choose(logits[[1, 4]])
    assert torch.equal(b_alone[0], b_ref[0])  # (B's rows: choose's own draw)


@interpreted
def test_pick_takes_the_kernel_only_where_it_applies(monkeypatch):
    """By default the kernel where FUSED and `kernels.available` (CUDA: patched in here),
    `choose` otherwise: on a CPU, with FUSED off, and for a batch with top-k / top-p rows,
    whose draws are choose's own. `select` hands back the distribution only for top-k."""
    monkeypatch.setattr(choose_mod, "FUSED", True)  # (the default; set for the test)
    logits = _logits(4, 500, 8, torch.float32)

    def run(params, **kw):
        choice = RowChoice.of(params, [([0, 1, 2, 3], torch.Generator().manual_seed(1))], CPU)
        return choice.pick(logits, **kw)

    hot, filtered = [SamplingParams(seed=1)] * 4, [SamplingParams(seed=1, top_k=50)] * 4
    ref = RowChoice.of(hot, [([0, 1, 2, 3], torch.Generator().manual_seed(1))], CPU)
    want = ref.choose(logits)
    fused = run(hot, fused=True)
    assert not torch.equal(fused[0], want[0])  # (a different draw: the test tells them apart)
    for got in (run(hot), run(hot, fused=False)):  # a CPU: choose
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    monkeypatch.setattr(choose_mod.kernels, "available", lambda dev: True)
    assert torch.equal(run(hot)[0], fused[0])
    monkeypatch.setattr(choose_mod, "FUSED", False)
    assert torch.equal(run(hot)[0], want[0])
    monkeypatch.setattr(choose_mod, "FUSED", True)
    top_k = RowChoice.of(filtered, [([0, 1, 2, 3], torch.Generator().manual_seed(1))],
                         CPU).choose(logits)
    assert torch.equal(run(filtered)[0], top_k[0])
    assert torch.equal(run(filtered, fused=True)[0], top_k[0])
    assert ref.select(logits, 0)[2] is None and ref.select(logits, 2)[2] is not None


def test_the_kernel_on_a_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    choice = RowChoice.of([SamplingParams()], [([0], None)], CPU)
    with pytest.raises(ValueError, match="cannot run on cpu"):
        choice.pick(torch.zeros((1, 8)), fused=True)


@interpreted
def test_a_running_batch_samples_through_the_kernel_alike_overlapped_or_not(tiny_dir, monkeypatch):
    """The kernel as the decode loop's default (`kernels.available` patched, as on CUDA):
    seeded requests whose samples stop at different steps (a class of 1 in 8 ids) sample the
    same tokens and logprobs overlapped (a stop redraws its request's live rows,
    decode_loop._follow) as synchronous, and request A's samples are the same alone."""
    from helpers import one_adapter_engine

    from twinkled.engine.running import RunningBatch
    from twinkled.engine.sampler import generate
    from twinkled.protocol.types import SampleRequest

    monkeypatch.setattr(choose_mod.kernels, "available", lambda dev: True)
    monkeypatch.setattr(choose_mod, "FUSED", True)
    monkeypatch.setattr(sample_rows, "ROWS", 8)  # (one program a step in the interpreter)
    calls = []
    monkeypatch.setattr(sample_rows, "sample", lambda *a, _f=sample_rows.sample, **kw: (
        calls.append(a[0].shape[0]), _f(*a, **kw))[1])
    eng = one_adapter_engine(tiny_dir)  # (the bare tiny model's rows are near one-hot)
    vocab = eng.model.vocab_size
    stops = torch.randperm(vocab, generator=torch.Generator().manual_seed(9))[:vocab // 8]
    gen = torch.Generator().manual_seed(1)

    def req(n, samples, **kw):
        prompt = torch.randint(5, vocab, (n,), generator=gen).tolist()
        return SampleRequest("a", prompt, SamplingParams(max_tokens=8, stop=stops.tolist(),
                                                          **kw), num_samples=samples)

    reqs = [req(7, 4, seed=1), req(5, 2, temperature=0.7, seed=2), req(6, 1, temperature=0.0)]

    def run(rs, overlap):
        batch = RunningBatch(eng.model, rows=8, pages=48, page_size=4, decode="eager",
                             kernels=False, overlap=overlap)
        return [[(s.tokens, s.logprobs) for s in r.sequences]
                for r in generate(eng.model, rs, [eng.pool.get("a")] * len(rs), batch=batch)]

    sync = run(reqs, False)
    # the kernel chose every token: the first tokens of the 7 rows, then one decode step a token
    assert calls[0] == 7 and len(calls) == max(len(t) for r in sync for t, _ in r)
    over, alone = run(reqs, True), run(reqs[:1], False)
    for got, want in ((over, sync), (alone, sync[:1])):
        for g, w in zip(got, want, strict=True):
            assert [t for t, _ in g] == [t for t, _ in w]
            for (_, a), (_, b) in zip(g, w, strict=True):
                assert a == pytest.approx(b, abs=1e-5)
    # a request's samples stopped at different steps (so the overlapped loop redrew)
    assert any(len({len(t) for t, _ in r}) > 1 for r in sync[:2])
