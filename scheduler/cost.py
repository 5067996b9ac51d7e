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
- Relative errors: a sample weighs 1/seconds^2, so a 2 s step's jitter does not drown the
  10 ms steps that pin down `fixed`.
- Robust: after a warm-up, a sample whose relative residual is far outside the recent
  spread is down-weighted (Huber), so a step slowed by a garbage collection or a restart
  does not bend the fit.
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
    def __init__(self, prior: tuple[float, ...] = PRIOR, decay: float = 0.99,
                 warmup: int = 8, huber_k: float = 3.0) -> None:
        self.prior = tuple(p * s for p, s in zip(prior, _SCALE, strict=True))  # scaled
        self.decay = decay
        self.warmup = warmup
        self.huber_k = huber_k
        k = len(FEATURES)
        self._xtx = [[0.0] * k for _ in range(k)]
        self._xty = [0.0] * k
        # The prior's pseudo-observations, relative-weighted like the data: P = sum w x x'/y^2
        # and q = sum w x / y; scaled by s (measured/prior) they add P/s^2 and q/s.
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
        self.scale = 1.0
        self.spread = 0.1  # typical |relative residual| of recent steps
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
        predicted = self.predict(shape)
        r = (seconds - predicted) / predicted
        h = 1.0
        if self.n >= self.warmup:
            if abs(r) > self.huber_k * self.spread:
                h = self.huber_k * self.spread / abs(r)
                self.outliers += 1
            # Winsorised, so one huge outlier moves the spread by a bounded step.
            self.spread = max(0.01, 0.95 * self.spread
                              + 0.05 * min(abs(r), self.huber_k * self.spread))
        self._ratios.append(seconds / _dot(self.prior, x))
        self.scale = sorted(self._ratios)[len(self._ratios) // 2]
        w = h / (seconds * seconds)
        d = self.decay
        for i, xi in enumerate(x):
            self._xty[i] = d * self._xty[i] + w * xi * seconds
            row = self._xtx[i]
            for j, xj in enumerate(x):
                row[j] = d * row[j] + w * xi * xj
        self.n += 1
        self._dirty = True

    def _solve(self) -> None:
        k = len(FEATURES)
        s = self.scale
        a = [[self._xtx[i][j] + self._p[i][j] / (s * s) for j in range(k)] for i in range(k)]
        b = [self._xty[i] + self._q[i] / s for i in range(k)]
        # Non-negative least squares, the simple way: a coefficient that comes out negative
        # is fixed at 0 and the rest solved again (at most k rounds of a 5x5 solve).
        free = list(range(k))
        coef = [0.0] * k
        while free:
            sol = _gauss([[a[i][j] for j in free] for i in free], [b[i] for i in free])
            neg = min(range(len(free)), key=lambda i: sol[i])
            if sol[neg] >= 0:
                coef = [0.0] * k
                for i, c in zip(free, sol, strict=True):
                    coef[i] = c
                break
            free.pop(neg)
        self._coef = coef
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
        long it then rides with others (one more); every step pays the fixed cost of a
        minimal step (fixed + one adapter) however few rows it holds. So the target is the
        shortest step whose fixed cost stays under MAX_OVERHEAD of it: a tenant alone then
        keeps >= 85% of what unbounded steps would give it. On a host-bound model (large
        fixed cost, rows nearly free) this is long and the token budget binds instead; on a
        compute-bound one it is a few rows. Floored (the daemon's own per-step work is not
        in the model) and capped (no newcomer waits long behind one step).
        """
        minimal = self.fixed_cost + self.adapter_cost
        return min(MAX_TARGET_S, max(MIN_TARGET_S, minimal / MAX_OVERHEAD))

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


def _dot(a, b) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


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
