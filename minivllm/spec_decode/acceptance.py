"""An online estimate of how likely each draft is to be accepted (vLLM #52228's estimator).

Per draft position k, a logistic model on one feature x of the draft (the top-2
logit margin of the draft's distribution; 0 for drafts without logits, where
the model reduces to a per-position rate):

    c_k(x) = sigmoid(w_k x + b_k)      P(draft k accepted | drafts < k accepted)

Fitted by Newton steps (IRLS) from sufficient statistics, no observations kept:
per position, H = sum c(1-c) [x, 1][x, 1]^T and g = sum (y - c) [x, 1] at the
predictions made when the drafts were scored (at least MIN_OBSERVATIONS of them
per position and window, so batch 1 refits after a few dozen steps). Every
`refit_interval` steps, or
sooner once the first position has `refit_observations` new observations (a batch
of 64 gathers them in one step: with 200, a batch-64 run whose drafts were rarely
accepted stopped drafting before its first refit and kept the optimistic prior, so
whether drafting restarted hung on the measured draft cost alone), each position
with enough observations takes one step theta += (H + ridge I)^-1 g and its statistics restart (so the fit
follows drift). Labels are censoring-aware:
with m drafts verified and a accepted, position k is observed iff k <= a and
k < m, and is a success iff k < a.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

INIT_BIAS = 1.5  # sigmoid(1.5) ~ 0.82 before any data
RIDGE = 1e-3
MIN_OBSERVATIONS = 24
MAX_FEATURE = 40.0


def sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))


@dataclass(slots=True)
class PositionStats:
    """The Newton step's sufficient statistics for one position since its last refit."""

    h_xx: float = 0.0
    h_x1: float = 0.0
    h_11: float = 0.0
    g_x: float = 0.0
    g_1: float = 0.0
    count: int = 0

    def add(self, x: float, predicted: float, label: bool) -> None:
        weight = predicted * (1 - predicted)
        residual = float(label) - predicted
        self.h_xx += weight * x * x
        self.h_x1 += weight * x
        self.h_11 += weight
        self.g_x += residual * x
        self.g_1 += residual
        self.count += 1


@dataclass
class AcceptanceEstimator:
    num_positions: int
    refit_interval: int = 32
    refit_observations: int = 64
    weights: list[float] = field(default_factory=list)
    biases: list[float] = field(default_factory=list)
    num_refits: int = 0

    def __post_init__(self) -> None:
        self.weights = [0.0] * self.num_positions
        self.biases = [INIT_BIAS] * self.num_positions
        self.stats = [PositionStats() for _ in range(self.num_positions)]
        self.fitted = [False] * self.num_positions  # refit from its own observations yet
        self.steps = 0
        self.steps_since_refit = 0

    def predict(self, position: int, x: float) -> float:
        x = min(x, MAX_FEATURE)
        return sigmoid(self.weights[position] * x + self.biases[position])

    def observe(self, features: list[float], num_verified: int, num_accepted: int) -> None:
        """One request's verification: drafts 0..num_verified-1 scored with `features`
        (the predictions are recomputed with the coefficients they were scored with)."""
        for k in range(min(num_verified, num_accepted + 1)):
            x = min(features[k], MAX_FEATURE) if k < len(features) else 0.0
            self.stats[k].add(x, self.predict(k, x), k < num_accepted)

    def step(self) -> None:
        """Count a step; every `refit_interval` steps, refit."""
        self.steps += 1
        self.steps_since_refit += 1
        if (
            self.steps_since_refit >= self.refit_interval
            or self.stats[0].count >= self.refit_observations
        ):
            self.refit()

    def refit(self) -> None:
        for k, s in enumerate(self.stats):
            if s.count >= MIN_OBSERVATIONS:
                self._newton_step(k, s)
                self.fitted[k] = True
            elif k and not self.fitted[k] and self.fitted[0]:
                # no data of its own yet (with rare acceptance, later positions are
                # seldom observed; position 0 is always observed most): start from the
                # position before, not the optimistic prior, since a later draft is
                # rarely likelier to pass than an earlier one
                self.weights[k], self.biases[k] = self.weights[k - 1], self.biases[k - 1]
            self.stats[k] = PositionStats()
        self.num_refits += 1
        self.steps_since_refit = 0

    def _newton_step(self, k: int, s: PositionStats) -> None:
        a, b, d = s.h_xx + RIDGE, s.h_x1, s.h_11 + RIDGE
        det = a * d - b * b
        if det <= 0:
            return
        dw = (d * s.g_x - b * s.g_1) / det
        db = (a * s.g_1 - b * s.g_x) / det
        weight = self.weights[k] + dw
        if weight < 0:  # a larger margin never means less agreement: refit the intercept alone
            weight, db = self.weights[k], s.g_1 / d
        self.weights[k] = weight
        self.biases[k] = self.biases[k] + db
