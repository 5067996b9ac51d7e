"""Steps bounded in time (issue 13, part 1), simulated: a synthetic step-cost function plays
the GPU, the planner's cost model learns it from the "measured" seconds, and we check what
the steps hold. No torch, no clocks, no timing assertions: every time here is synthetic."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from scheduler import TRAIN, CostModel, Planner, StepShape, Work
from scheduler.cost import MAX_OVERHEAD, MAX_TARGET_S, MIN_TARGET_S

_ids = itertools.count()


class Machine:
    """A synthetic card: seconds = fixed + tokens + attention + rows + adapters, with
    multiplicative noise and, now and then, an outlier (a step slowed 2-5x)."""

    def __init__(self, fixed=0.004, per_token=40e-6, per_pair=0.0, per_row=0.0,
                 per_adapter=0.001, noise=0.05, outliers=0.0, seed=0):
        self.c = (fixed, per_token, per_pair, per_row, per_adapter)
        self.noise, self.outliers = noise, outliers
        self.rng = random.Random(seed)

    def exact(self, s: StepShape) -> float:
        f, t, p, r, a = self.c
        return f + t * s.tokens + p * s.pairs + r * s.rows + a * s.adapters

    def rows(self, lengths: list[int]) -> float:
        """What these rows add to a step (no fixed or adapter cost)."""
        _, t, p, r, _ = self.c
        return sum(t * n + p * n * n + r for n in lengths)

    def measure(self, s: StepShape) -> float:
        y = self.exact(s) * self.rng.lognormvariate(0, self.noise)
        if self.rng.random() < self.outliers:
            y *= self.rng.uniform(2, 5)
        return y


def op(tenant, model, seq, rows, length):
    return Work(f"w{next(_ids)}", tenant, TRAIN, rows * length, model, seq,
                parts=[length] * rows)


class Tenant:
    """A client that keeps `inflight` requests of `rows` x `length` queued per model, with
    an optim_step behind each (as a tinker training loop sends them)."""

    def __init__(self, p: Planner, name: str, models: int, rows: int, length: int,
                 inflight: int = 2):
        self.p, self.name, self.rows, self.length = p, name, rows, length
        self.models = [f"{name}:{i}" for i in range(models)]
        self.seq = dict.fromkeys(self.models, 1)
        self.queued = dict.fromkeys(self.models, 0)
        self.inflight = inflight
        for m in self.models:
            p.open_model(m, name)

    def top_up(self):
        for m in self.models:
            while self.queued[m] < self.inflight:
                self.p.submit(op(self.name, m, self.seq[m], self.rows, self.length))
                self.p.submit(Work(f"w{next(_ids)}", self.name, "optim", 0, m, self.seq[m] + 1))
                self.seq[m] += 2
                self.queued[m] += 1

    def done(self, step):
        for w in step.work:
            if w.tenant == self.name and w.kind == "optim":
                self.queued[w.model] -= 1


def run(p: Planner, card: Machine, tenants: list[Tenant], steps: int):
    """Run `steps` steps, every one measured on `card`; returns (step, true seconds)."""
    out = []
    for _ in range(steps):
        for t in tenants:
            t.top_up()
        s = p.next_step()
        if s is None:
            break
        seconds = card.measure(s.shape) if s.kind == "train" else None
        p.complete(s, seconds)
        for t in tenants:
            t.done(s)
        out.append((s, seconds))
    return out


# -- the cost model ---------------------------------------------------------------------


def random_shape(rng, small: float = 0.0) -> StepShape:
    """A step of 1-6 adapters x 1-8 rows of mixed lengths; with probability `small`, one
    adapter's one or two rows (what a tenant alone, or a cut op's last piece, gives)."""
    s = StepShape()
    if rng.random() < small:
        s.add([rng.choice([16, 64, 256, 1024])] * rng.randint(1, 2), True)
        return s
    for _ in range(rng.randint(1, 6)):
        s.add([rng.choice([16, 64, 256, 1024, 2048]) for _ in range(rng.randint(1, 8))], True)
    return s


def test_the_cost_model_recovers_known_coefficients_from_noisy_samples():
    # Every term matters somewhere: attention is as costly as the linear layers at 2048
    # tokens a row, a row costs as much as 50 tokens, an adapter as much as 125 tokens.
    card = Machine(fixed=0.01, per_token=20e-6, per_pair=1e-8, per_row=1e-3,
                   per_adapter=2.5e-3, noise=0.03, outliers=0.05, seed=1)
    model = CostModel(decay=1.0)
    rng = random.Random(2)
    for _ in range(1500):
        s = random_shape(rng)
        model.observe(s, card.measure(s))
    got = model.describe()
    want = {"fixed_ms": 10, "per_1k_tokens_ms": 20, "per_1m_pairs_ms": 10, "per_row_ms": 1,
            "per_adapter_ms": 2.5}
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=0.15), (key, got)
    assert model.outliers >= 40  # the ~75 slowed steps were seen as such
    errors = sorted(abs(model.predict(s) / card.exact(s) - 1)
                    for s in (random_shape(rng) for _ in range(200)))
    assert errors[100] < 0.03 and errors[190] < 0.06  # median and p95 relative error


def test_the_cost_model_follows_a_machine_that_slows_down():
    card = Machine(noise=0.02, seed=3)
    model = CostModel()
    rng = random.Random(4)
    for _ in range(300):
        s = random_shape(rng)
        model.observe(s, card.measure(s))
    probe = StepShape(adapters=2)
    probe.add([512] * 8)
    assert model.predict(probe) == pytest.approx(card.exact(probe), rel=0.05)
    card.c = tuple(2 * c for c in card.c)  # other load arrives: everything takes twice as long
    for _ in range(800):  # (the statistics decay by half every ~140 steps)
        s = random_shape(rng)
        model.observe(s, card.measure(s))
    assert model.predict(probe) == pytest.approx(card.exact(probe), rel=0.05)


def test_before_any_measurement_the_prior_gives_a_sane_target():
    model = CostModel()
    target = model.auto_target()
    assert MIN_TARGET_S <= target <= MAX_TARGET_S
    one = StepShape(adapters=1)
    one.add([512])
    assert 0 < model.predict(one) < target  # one row fits a step
    assert all(c >= 0 for c in model.coef)
    model.observe(one, -1.0)  # nonsense is ignored
    model.observe(one, math.nan)
    model.observe(StepShape(), 0.5)  # a step without rows says nothing of rows
    assert model.n == 0


def test_the_auto_target_keeps_the_fixed_cost_a_small_share():
    for fixed in (0.001, 0.01, 0.05, 1.0):
        card = Machine(fixed=fixed, noise=0.0)
        model = CostModel()
        rng = random.Random(5)
        for _ in range(200):
            s = random_shape(rng, small=0.5)
            model.observe(s, card.measure(s))
        # The overhead of a typical step: fixed, and its adapters (1-6 here, half of them 1).
        assert 1.5 < model.adapters < 3.5
        overhead = fixed + card.c[4] * model.adapters
        want = min(MAX_TARGET_S, max(MIN_TARGET_S, overhead / MAX_OVERHEAD))
        assert model.auto_target() == pytest.approx(want, rel=0.05), fixed


# -- the planner, sizing steps by time ----------------------------------------------------

# A compute-bound card: a row of 512 tokens costs 20 ms, four times a minimal step (fixed +
# one adapter: 5 ms), as on a large model. The auto target is then 5 ms / MAX_OVERHEAD.
COMPUTE_BOUND = dict(fixed=0.004, per_token=40e-6, per_adapter=0.001)
AUTO = (0.004 + 0.001) / MAX_OVERHEAD


def test_steps_are_filled_to_the_time_target_and_big_requests_cut_to_fit():
    card = Machine(**COMPUTE_BOUND, noise=0.05, outliers=0.02, seed=6)
    p = Planner(token_budget=16384)
    flooder = Tenant(p, "flood", models=3, rows=32, length=128, inflight=2)
    steps = run(p, card, [flooder], 400)
    assert p.step_target() == pytest.approx(AUTO, rel=0.2)  # learned from the steps
    row = card.rows([128])
    train = [s for s, _ in steps[100:] if s.kind == "train"]
    assert len(train) > 250
    for s in train:
        assert card.exact(s.shape) <= 1.1 * (AUTO + row)  # at most a datum past the target
        if any(not w.final for w in s.work):  # an op was cut: the step was full
            assert card.exact(s.shape) >= 0.9 * AUTO / 2  # (half: every 8th is a probe)
    full = [s for s in train if card.exact(s.shape) >= 0.9 * AUTO]
    assert len(full) > 0.6 * len(train)
    # The 4096-token requests (160 ms each) went through in pieces of a few rows.
    assert max(s.shape.tokens for s in train) < 4096 / 2
    assert sum(w.kind == "optim" for s, _ in steps for w in s.work) > 50


def test_a_fixed_target_is_honoured_and_zero_means_tokens_only():
    card = Machine(**COMPUTE_BOUND, noise=0.0)
    for target in (0.05, 0.2):
        p = Planner(token_budget=16384, target_step_s=target)
        steps = run(p, card, [Tenant(p, "f", models=2, rows=64, length=128)], 100)
        for s, _ in steps[30:]:
            t = card.exact(s.shape)
            assert t <= 1.05 * (target + card.rows([128]))  # (the model is 2-5% off)
            assert t >= 0.97 * target or all(w.final for w in s.work)  # full, or no work left
    p = Planner(token_budget=4096, target_step_s=0)
    steps = run(p, card, [Tenant(p, "f", models=2, rows=64, length=128)], 50)
    assert {s.shape.tokens for s, _ in steps[5:] if s.kind == "train"} == {4096}


def test_a_small_tenant_next_to_a_flooder_waits_about_one_short_step():
    def arrive(target):
        card = Machine(**COMPUTE_BOUND, noise=0.05, seed=7)
        p = Planner(token_budget=16384, target_step_s=target)
        flooder = Tenant(p, "flood", models=4, rows=32, length=256, inflight=3)
        steps = run(p, card, [flooder], 200)
        running = card.exact(steps[-1][0].shape)  # the step it arrives during
        small = Tenant(p, "small", models=1, rows=1, length=128)
        small.top_up()
        nxt = run(p, card, [flooder], 1)[0][0]
        assert any(w.tenant == "small" and w.kind == TRAIN for w in nxt.work)
        assert any(w.tenant == "small" and w.kind == "optim" for w in nxt.work)
        return running, card.exact(nxt.shape)  # the step it waits for, the one it rides

    alone = COMPUTE_BOUND["fixed"] + COMPUTE_BOUND["per_adapter"] + 128 * 40e-6
    datum = 256 * 40e-6  # one of the flooder's
    wait, ride = arrive(None)
    assert wait <= 1.1 * (AUTO + datum)  # at most one short step ...
    # ... then a step about twice its own (the flooder had as much time as it in it),
    assert ride <= 1.1 * (2 * alone + datum)
    old_wait, old_ride = arrive(0)
    assert old_wait + old_ride > 10 * (wait + ride)  # not steps as long as the whole budget
    assert old_ride > 50 * alone


def test_weighted_time_shares_converge_to_the_weights():
    # Long rows pay for attention, short rows for per-row work: by tokens, these two tenants
    # cost very differently per token, so sharing by tokens would not give 2:1 in time.
    card = Machine(fixed=0.004, per_token=10e-6, per_pair=2e-8, per_row=0.002,
                   per_adapter=0.001, noise=0.05, seed=8)  # 52 vs 135 us per token
    p = Planner(token_budget=65536)
    p.set_tenant("long", weight=2)
    p.set_tenant("short", weight=1)
    long = Tenant(p, "long", models=2, rows=4, length=2048)
    short = Tenant(p, "short", models=2, rows=128, length=16)
    steps = run(p, card, [long, short], 800)
    used = {"long": 0.0, "short": 0.0}
    tokens = {"long": 0, "short": 0}
    for s, _ in steps[200:]:
        if s.kind != "train":
            continue
        own = {"long": 0.0, "short": 0.0}
        for w in s.work:
            if w.kind == TRAIN:
                n = (w.hi or len(w.parts or [1])) - w.lo
                own[w.tenant] += card.rows([2048 if w.tenant == "long" else 16] * n)
                tokens[w.tenant] += w.tokens
        for t in own:  # each pays its rows, its adapters and its part of the fixed cost
            adapters = len({w.model for w in s.work if w.tenant == t})
            used[t] += own[t] + adapters * 0.001 + 0.004 * own[t] / sum(own.values())
    share = used["long"] / sum(used.values())
    assert share == pytest.approx(2 / 3, abs=0.04)
    assert abs(tokens["long"] / sum(tokens.values()) - 2 / 3) > 0.1  # tokens would not do
    status = p.status()
    assert status["long"]["share"] == pytest.approx(2 / 3, abs=0.04)


def flooder_alone(card: Machine, target: float | None, steps: int = 300) -> float:
    """Tokens per (synthetic) second of a flooder alone, after the model has learned."""
    p = Planner(token_budget=16384, target_step_s=target)
    done = run(p, card, [Tenant(p, "flood", models=2, rows=16, length=512, inflight=3)], steps)
    train = [s for s, _ in done[steps // 3:] if s.kind == "train"]
    return sum(s.shape.tokens for s in train) / sum(card.exact(s.shape) for s in train)


@pytest.mark.parametrize("row_len", [64, 512, 2048])
def test_a_flooder_alone_keeps_its_throughput(row_len):
    card = Machine(**COMPUTE_BOUND, noise=0.05, seed=9)
    old = flooder_alone(card, 0)
    new = flooder_alone(card, None)
    assert new >= 0.85 * old, (new, old)


def test_on_a_host_bound_card_the_token_budget_binds_as_before():
    # 100 ms a step whatever it holds, rows nearly free (a small model on a big card).
    card = Machine(fixed=0.1, per_token=1e-6, per_adapter=0.0005, noise=0.05, seed=10)
    p = Planner(token_budget=16384)
    steps = run(p, card, [Tenant(p, "flood", models=4, rows=16, length=512)], 200)
    assert p.step_target() > 0.2  # well above what a full step takes (0.118 s)
    sizes = [s.shape.tokens for s, _ in steps[50:] if s.kind == "train"]
    assert sizes.count(16384) > 0.8 * len(sizes)  # all but the probes


def test_target_step_ms_in_the_config(tmp_path):
    from twinkled.protocol.config import Config, check_config

    assert Config().target_step_s is None  # "auto": the planner derives it
    assert Config(target_step_ms=0).target_step_s == 0  # off: token_budget only
    assert Config(target_step_ms=250).target_step_s == 0.25
    with pytest.raises(ValueError, match="auto"):
        _ = Config(target_step_ms="fast").target_step_s
    path = tmp_path / "twinkled.toml"
    for text, ok in (('target_step_ms = "auto"', True), ("target_step_ms = 0", True),
                     ("target_step_ms = 120.5", True), ("target_step_ms = -1", False),
                     ('target_step_ms = "fast"', False)):
        path.write_text(text + "\n")
        problems = check_config(path)
        assert (problems == []) == ok, (text, problems)
        if not ok:
            assert problems[0].startswith("target_step_ms: must be \"auto\" or a number")


def test_the_first_steps_are_predicted_at_the_measured_speed():
    """Before a step is learnt from (LAG steps later), the prior is scaled to what was
    measured: a CPU 100x slower than the prior's GPU is predicted as such at once."""
    card = Machine(fixed=3.0, per_token=2e-3, per_adapter=0.2, noise=0.0)
    model = CostModel()
    shape = StepShape(adapters=1)
    shape.add([512] * 4)
    model.observe(shape, card.exact(shape))
    assert model.predict(shape) == pytest.approx(card.exact(shape), rel=1e-6)


def test_a_probe_never_splits_a_step_that_holds_all_the_waiting_work():
    # Host-bound (0.1 s a step) so the automatic target (~0.67 s) does not bind on eight
    # 512-token rows (0.35 s), but half of it would: a probe of that step would leave some
    # tenants a whole step behind (seen through the daemon on an H100: p99 x2).
    card = Machine(fixed=0.1, per_token=60e-6, per_adapter=0.0, noise=0.02, seed=11)
    p = Planner(token_budget=16384)
    tenants = [Tenant(p, f"t{i}", models=1, rows=1, length=512, inflight=1) for i in range(8)]
    steps = run(p, card, tenants, 200)
    assert p.step_target() > 0.5
    train = [s for s, _ in steps if s.kind == "train"]
    assert len(train) > 50
    assert all(len({w.tenant for w in s.work}) == 8 for s in train), \
        sorted({len({w.tenant for w in s.work}) for s in train})
