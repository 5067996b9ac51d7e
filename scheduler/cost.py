"""What a training step costs, in seconds: a linear model learned online from measured steps.

    seconds ~ fixed + per_token * tokens + per_pair * sum(len^2) + per_row * rows
                    + per_adapter * adapters

`tokens` is what the linear layers cost, `sum(len^2)` what attention costs (token pairs of
each row), `rows` and `adapters` the per-row and per-adapter work (LoRA segments, losses,
the optimizer step that follows a model's rows). `fixed` is what any step costs however
small: kernel launches, the round trip to the workers, the host side of the step.

The daemon reports each training step's shape and measured seconds (`observe`); the planner
asks for predictions while it packs a step. Fitting, pure Python and O(1) per step:

- Weighted least squares on decayed sufficient statistics (X'WX, X'Wy, forgetting factor
  `decay` per step), so the model follows a machine whose speed changes (other load, a
  restarted worker) without keeping a window of samples.
- Relative errors: a sample weighs (level/seconds)^2, `level` the machine's current speed
  against the prior's, so a 2 s step's jitter does not drown the 10 ms steps that pin down
  `fixed`, and a machine that slows down as a whole keeps its old and new samples' weights.
- Robust: a sample whose relative residual is far outside the recent spread, and over
  MIN_OUTLIER, is down-weighted (Huber), so a step slowed by a garbage collection or a
  restart does not bend the fit. The floor matters: a model that is wrong in a direction
  few steps explore (the fixed cost, seen in the rare small steps) mispredicts exactly
  those steps by 20-40%; calling them outliers would keep it wrong for good.
- A prior before (and beside) measurements: pseudo-observations of a typical GPU step at
  five different shapes, scaled by the median ratio measured/prior, so only the prior's
  *proportions* matter; the data override it in every direction they determine. With steps
  that all look alike (one tenant, equal rows) the data determine one direction only, and
  the prior keeps the rest sensible instead of letting it drift.
- Coefficients are kept non-negative (a step never gets cheaper with more rows).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

FEATURES = ("fixed", "tokens", "pairs", "rows", "adapters")
# Features are divided by these so that the normal equations stay well-conditioned (a step
# has ~1e4 tokens and ~1e7-1e9 token pairs but ~10 rows).
_SCALE = (1.0, 1e3, 1e6, 10.0, 1.0)
# The prior, in seconds per unit: a GPU step of a mid-size model (30 ms of fixed cost,
# 50k tokens/s, attention as costly as the linear layers at ~16k tokens per row).
PRIOR = (0.03, 2e-5, 2e-5 / 16384, 2e-4, 2e-3)
# (tokens per row, rows, adapters) of the prior's pseudo-observations: shapes different
# enough that every coefficient is pinned.
_PRIOR_SHAPES = ((64, 1, 1), (1024, 1, 1), (512, 16, 8), (128, 64, 2), (4096, 4, 1))
LAG = 8  # a step is learnt from when 8 more have been measured (see observe)
MIN_OUTLIER = 0.5  # a step is an outlier only if at least 50% off (and 3 spreads)
PRIOR_WEIGHT = 0.05  # each pseudo-observation counts as 1/20 of a measured step

# The automatic step-time target (see CostModel.auto_target).
MAX_OVERHEAD = 0.15  # a step's fixed cost is at most this share of the target
MIN_TARGET_S = 0.025  # below this the daemon's own per-step work (not modelled) dominates
MAX_TARGET_S = 2.0  # no newcomer waits longer than this behind one step


@dataclass
class StepShape:
    """What a training step holds, as far as its cost goes."""

    tokens: int = 0
    rows: int = 0
    pairs: int = 0  # sum of squared row lengths
    adapters: int = 0

    def add(self, lengths: Iterable[int], new_adapter: bool = False) -> None:
        for n in lengths:
            self.tokens += n
            self.rows += 1
            self.pairs += n * n
        self.adapters += new_adapter

    def features(self) -> tuple[float, ...]:
        raw = (1.0, self.tokens, self.pairs, self.rows, self.adapters)
        return tuple(x / s for x, s in zip(raw, _SCALE, strict=True))


def _raw_shape(row_len: int, rows: int, adapters: int) -> StepShape:
    s = StepShape(adapters=adapters)
    s.add([row_len] * rows)
    return s


class CostModel:
    """The step-time model of one daemon (in memory): observe() measured steps, predict()."""

    def __init__(self, prior: tuple[float, ...] = PRIOR, decay: float = 0.995,
                 huber_k: float = 3.0) -> None:
        self.prior = tuple(p * s for p, s in zip(prior, _SCALE, strict=True))  # scaled
        self.decay = decay
        self.huber_k = huber_k
        k = len(FEATURES)
        self._xtx = [[0.0] * k for _ in range(k)]
        self._xty = [0.0] * k
        # The prior's pseudo-observations, weighted like the data: P = sum w x x'/y^2 and
        # q = sum w x / y; with their targets scaled by s (measured/prior): P and s q.
        self._p = [[0.0] * k for _ in range(k)]
        self._q = [0.0] * k
        for row_len, rows, adapters in _PRIOR_SHAPES:
            x = _raw_shape(row_len, rows, adapters).features()
            y = _dot(self.prior, x)
            for i in range(k):
                self._q[i] += PRIOR_WEIGHT * x[i] / y
                for j in range(k):
                    self._p[i][j] += PRIOR_WEIGHT * x[i] * x[j] / (y * y)
        self._ratios: deque[float] = deque(maxlen=31)  # measured / prior, recent steps
        self._window: deque[tuple] = deque(maxlen=2 * LAG + 1)  # (features, seconds)
        self.scale = 1.0
        self.spread = 0.1  # typical |relative residual| of recent steps
        self.adapters = 1.0  # adapters in a recent step, a moving average (auto_target)
        self.n = 0  # steps observed
        self.outliers = 0  # steps down-weighted as outliers
        self._coef = list(self.prior)
        self._dirty = False

    # -- learning -----------------------------------------------------------------------

    def observe(self, shape: StepShape, seconds: float) -> None:
        """A training step of `shape` took `seconds` (measured by the daemon)."""
        if not (seconds > 0 and math.isfinite(seconds)) or shape.rows <= 0:
            return
        x = shape.features()
        self._ratios.append(seconds / _dot(self.prior, x))
        self.scale = _median(self._ratios)
        self._dirty = True  # the prior's part moves with the scale, from the first step
        # A step is judged when LAG later steps have been seen, against its neighbours on
        # both sides: the first steps of a daemon are judged too (one of them may be the
        # slowest of all: CUDA and allocator warm-up), and a change of speed is told from
        # one slow step by the steps after it.
        self.adapters = 0.9 * self.adapters + 0.1 * max(1, shape.adapters)
        self._window.append((x, seconds))
        if len(self._window) > LAG:
            self._learn(len(self._window) - LAG - 1)
        self.n += 1

    def _learn(self, i: int) -> None:
        ratios = [y / max(1e-9, _dot(self.coef, x)) for x, y in self._window]
        x, seconds = self._window[i]
        # The residual against the prediction times the window's median ratio: when the
        # machine as a whole slows down (other load), its steps are not outliers.
        r = ratios[i] / _median(ratios) - 1
        h = 1.0
        limit = max(MIN_OUTLIER, self.huber_k * self.spread)
        if abs(r) > limit:
            h = limit / abs(r)
            self.outliers += 1
        # Winsorised, so one huge outlier moves the spread by a bounded step.
        self.spread = max(0.01, 0.95 * self.spread + 0.05 * min(abs(r), limit))
        # Relative errors, at the machine's current level: a step slower than its peers
        # weighs less, whatever the level; a machine slowing down as a whole does not make
        # its new steps weigh less than its old ones.
        w = h * (self.scale / seconds) ** 2
        d = self.decay
        for k, xk in enumerate(x):
            self._xty[k] = d * self._xty[k] + w * xk * seconds
            row = self._xtx[k]
            for j, xj in enumerate(x):
                row[j] = d * row[j] + w * xk * xj
        self._dirty = True

    def _solve(self) -> None:
        k = len(FEATURES)
        s = self.scale
        a = [[self._xtx[i][j] + self._p[i][j] for j in range(k)] for i in range(k)]
        b = [self._xty[i] + self._q[i] * s for i in range(k)]
        self._coef = _nnls(a, b)
        self._dirty = False

    # -- predicting ---------------------------------------------------------------------

    @property
    def coef(self) -> list[float]:
        """Coefficients on the scaled features (solved lazily after new measurements)."""
        if self._dirty:
            self._solve()
        return self._coef

    def predict(self, shape: StepShape) -> float:
        """Predicted seconds of a step of `shape` (never below a microsecond)."""
        return max(1e-6, _dot(self.coef, shape.features()))

    def row_cost(self, length: int) -> float:
        """What one more row of `length` tokens adds to a step."""
        c = self.coef
        return (c[1] * length / _SCALE[1] + c[2] * length * length / _SCALE[2]
                + c[3] / _SCALE[3])

    @property
    def adapter_cost(self) -> float:
        """What one more adapter (its first row in the step) adds."""
        return self.coef[4]

    @property
    def fixed_cost(self) -> float:
        return self.coef[0]

    def auto_target(self) -> float:
        """The step time to aim at when the operator set none, in seconds.

        Short steps bound how long a newly arrived request waits (about one step) and how
        long it then rides with others (one more); every step pays its overhead (the fixed
        cost and its adapters' cost) however few rows it holds. So the target is the
        shortest step whose overhead stays under MAX_OVERHEAD of it: the tenants then keep
        >= 85% of what unbounded steps would give them. On a host-bound model (large fixed
        cost, rows nearly free) this is long and the token budget binds instead; on a
        compute-bound one it is a few rows. Floored (the daemon's own per-step work is not
        in the model) and capped (no newcomer waits long behind one step).

        The overhead counts the adapters of a typical recent step, not one: when every step
        holds the same tenants, the fit cannot tell the fixed cost from their adapters' and
        may put it all on the adapters (seen on a CPU daemon with 8 equal tenants: fixed
        0 ms, 5.9 ms an adapter); counting one adapter then gave a 36 ms target that split
        every step of the 8 in two.
        """
        overhead = self.fixed_cost + self.adapter_cost * self.adapters
        return min(MAX_TARGET_S, max(MIN_TARGET_S, overhead / MAX_OVERHEAD))

    def steps_vary(self) -> bool:
        """Whether the recent steps differ enough in size (1.5x in tokens) to tell the
        fixed cost from what rows cost, without a probe (see packing.is_probe)."""
        tokens = [x[1] for x, _ in self._window]
        return len(tokens) > LAG and max(tokens) >= 1.5 * min(tokens)

    def describe(self) -> dict:
        """The fitted model in readable units (for `twinkled ctl status`)."""
        c = self.coef
        return {"steps_observed": self.n, "outliers": self.outliers,
                "fixed_ms": round(c[0] * 1e3, 3),
                "per_1k_tokens_ms": round(c[1] * 1e3, 3),
                "per_1m_pairs_ms": round(c[2] * 1e3, 3),
                "per_row_ms": round(c[3] / _SCALE[3] * 1e3, 3),
                "per_adapter_ms": round(c[4] * 1e3, 3),
                "spread": round(self.spread, 3)}


def _median(xs) -> float:
    return sorted(xs)[len(xs) // 2]


def _dot(a, b) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def _nnls(a: list[list[float]], b: list[float]) -> list[float]:
    """min x'ax/2 - b'x over x >= 0 (the normal equations of non-negative least squares):
    Lawson and Hanson's active-set method, a handful of small solves. Coefficients fixed at
    0 may come back when the others change (dropping them one by one for good, the simple
    way, can strand the fit: the intercept dropped, the rows made to pay for it)."""
    n = len(b)
    x = [0.0] * n
    free: list[int] = []
    for _ in range(3 * n):
        grad = [b[i] - sum(a[i][j] * x[j] for j in range(n)) for i in range(n)]
        out = [i for i in range(n) if i not in free and grad[i] > 1e-12 * (abs(b[i]) + 1e-300)]
        if not out:
            break
        free.append(max(out, key=lambda i: grad[i]))
        while True:
            z = [0.0] * n
            for i, v in zip(free, _gauss([[a[i][j] for j in free] for i in free],
                                         [b[i] for i in free]), strict=True):
                z[i] = v
            if all(z[i] > 0 for i in free):
                x = z
                break
            # Step from x toward z as far as stays feasible; drop what reaches 0.
            step = min(x[i] / (x[i] - z[i]) for i in free if z[i] <= 0)
            x = [xi + step * (zi - xi) for xi, zi in zip(x, z, strict=True)]
            free = [i for i in free if x[i] > 1e-15]
            for i in range(n):
                if i not in free:
                    x[i] = 0.0
            if not free:
                break
    return x


def _gauss(a: list[list[float]], b: list[float]) -> list[float]:
    """Solve a x = b (a symmetric positive definite, small) by elimination with pivoting."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[piv] = m[piv], m[col]
        p = m[col][col]
        if abs(p) < 1e-300:
            continue  # a free direction (cannot happen with the prior in place)
        for r in range(col + 1, n):
            f = m[r][col] / p
            if f:
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        p = m[r][r]
        x[r] = 0.0 if abs(p) < 1e-300 else (m[r][n] - sum(m[r][c] * x[c]
                                                         for c in range(r + 1, n))) / p
    return x
