"""Adaptive verification: verify only the drafts that pay for themselves (vLLM #47808, #52228).

Given every request's drafts and the estimator's conditional acceptance c_{r,k},
the survival S_{r,k} = prod_{j<=k} c_{r,j} is the chance that draft k of request
r is emitted. Verifying the B best (request, position) slots yields, in
expectation, N + sum_{i<=B} s_(i) tokens (N: one token per sampling request,
which verification always gives) for a step costing C_draft(R) + C_verify(N + B).
Per step the planner takes the global argmax over B of that ratio (the cost
curve is a staircase, so the maximum can sit anywhere) and keeps the B best
slots; S falls along a request, so each request keeps a prefix of its drafts.

The verify cost curve (seconds per target step against tokens) is profiled at
start-up on this machine; the draft cost is measured online per number of
requests. Without a profiled curve nothing is trimmed (every extra token
would look free). The first `warmup_refits` refits may verify full blocks (vLLM
warms up so); the default is none, a deliberate difference: our estimator models
acceptance given the draft's margin, and its labels are censoring-aware, so
trimming selects on the feature without biasing the fit, while the optimistic
prior (0.82) keeps early steps verifying; on short runs at batch 1 vLLM's 300-step
warm-up was all a run did (measured 0.68x plain before, 1.04x without); after that, one step
in `explore_interval` verifies every draft of one request in `explore_fraction`,
so an estimator that has come to trim everything keeps receiving the labels that
could change its mind. Each plan also asks whether a whole speculative
step (drafting included, for every request) beats a plain one; after `idle_plans`
plans that say no (or one that says it loses by more than a fifth), the proposer
is not run at all, except for the exploring requests, until a plan says yes again;
each exploration that still says no doubles the interval to the next (up to 8x).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from minivllm.spec_decode.acceptance import AcceptanceEstimator

# a plan whose whole speculative step runs below this share of a plain step's tokens per
# second stops drafting at once, without waiting for `idle_plans` such plans
CLEAR_LOSS = 0.8
# while drafting is off, exploration steps come at most this many times less often
MAX_EXPLORE_BACKOFF = 8


@dataclass
class CostCurve:
    """Seconds per step against its number of tokens: monotone piecewise-linear through
    points measured with one token of context per row, plus `attention_seconds` per
    (token, context token) pair beyond the first (a verification at 200 tokens of context
    attends 200 times as much as the profile's rows did)."""

    sizes: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    attention_seconds: float = 0.0

    @classmethod
    def from_points(cls, points: dict[int, float], attention_seconds: float = 0.0) -> CostCurve:
        sizes = sorted(points)
        seconds, running = [], 0.0
        for size in sizes:  # a larger step never costs less (running max)
            running = max(running, points[size])
            seconds.append(running)
        return cls(sizes, seconds, attention_seconds)

    def __call__(self, size: int, context: float = 1.0) -> float:
        """A step of `size` tokens whose rows see `context` tokens on average."""
        return self._curve(size) + self.attention_seconds * size * max(context - 1.0, 0.0)

    def _curve(self, size: int) -> float:
        if not self.sizes:
            return 0.0
        i = bisect.bisect_left(self.sizes, size)
        if i < len(self.sizes) and self.sizes[i] == size:
            return self.seconds[i]
        if i == 0:
            return self.seconds[0]
        if i == len(self.sizes):  # extrapolate along the last segment
            i -= 1
        lo, hi = i - 1, i
        if self.sizes[hi] == self.sizes[lo]:
            return self.seconds[hi]
        frac = (size - self.sizes[lo]) / (self.sizes[hi] - self.sizes[lo])
        return max(self.seconds[lo] + frac * (self.seconds[hi] - self.seconds[lo]), 0.0)


class DraftCost:
    """Exponential moving averages of the proposer's seconds, per power-of-two request count."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.buckets: dict[int, float] = {}

    def observe(self, num_requests: int, seconds: float) -> None:
        key = max(num_requests, 1).bit_length()
        old = self.buckets.get(key)
        self.buckets[key] = seconds if old is None else old + self.alpha * (seconds - old)

    def __call__(self, num_requests: int) -> float:
        """The bucket's average; an unobserved bucket scales its nearest observed one
        (proportionally to the request count), and nothing observed costs nothing."""
        key = max(num_requests, 1).bit_length()
        if key in self.buckets or not self.buckets:
            return self.buckets.get(key, 0.0)
        nearest = min(self.buckets, key=lambda k: (abs(k - key), -k))
        return self.buckets[nearest] * 2.0 ** (key - nearest)


@dataclass(slots=True)
class Plan:
    admitted: list[int]  # per request: how many of its drafts to verify
    expected_tokens: float
    expected_seconds: float


class AdaptiveVerifier:
    def __init__(
        self,
        num_positions: int,
        verify_cost: CostCurve,
        warmup_refits: int = 0,
        explore_interval: int = 20,
        explore_fraction: int = 8,
        idle_plans: int = 3,
    ) -> None:
        self.estimator = AcceptanceEstimator(num_positions)
        self.verify_cost = verify_cost
        self.draft_cost = DraftCost()
        self.warmup_refits = warmup_refits
        self.explore_interval = explore_interval
        self.explore_fraction = explore_fraction
        self.idle_plans = idle_plans
        # exploring steps back off while drafting stays off (x2 per exploration that still
        # says no, up to MAX_EXPLORE_BACKOFF x), and return to every `explore_interval`
        # steps as soon as a plan says drafting pays
        self.interval = explore_interval
        self.num_explorations = 0
        self.since_exploration = 0
        self.num_plans = 0
        self.num_empty_plans = 0  # consecutive plans by which drafting did not pay
        self.num_trimmed = 0  # draft slots not verified, in total

    @property
    def exploring(self) -> bool:
        """Whether the coming plan is an exploration step."""
        return self.since_exploration + 1 >= self.interval

    def _count_plan(self, explored: bool) -> None:
        self.num_plans += 1
        if explored:
            self.num_explorations += 1
            self.since_exploration = 0
        else:
            self.since_exploration += 1

    def explorers(self, num_requests: int) -> list[int]:
        """The requests an exploration step drafts fully for (rotating between steps)."""
        if num_requests <= 0:
            return []
        step = max(self.explore_fraction, 1)
        offset = self.num_explorations % step
        return list(range(offset % num_requests, num_requests, step)) or [0]

    def should_draft(self) -> bool:
        """False once drafting has stopped paying: every request skips the proposer."""
        return self.warming_up or self.num_empty_plans < self.idle_plans

    def skip(self) -> None:
        """A step on which nothing was proposed (still counts towards exploration)."""
        self._count_plan(self.exploring)

    @property
    def warming_up(self) -> bool:
        return self.estimator.num_refits < self.warmup_refits or not self.verify_cost.sizes

    def _best(
        self,
        slots: list[tuple[float, int]],
        num_reqs: int,
        base: int,
        fixed: float,
        scale: float = 1.0,
        context: float = 1.0,
    ) -> tuple[int, float, float]:
        """(B, expected tokens, seconds) maximising tokens per second when the B best slots
        are verified and `fixed` seconds are spent besides the verification; `scale`
        extrapolates the slots of the drafting requests to `scale` times as many."""
        best = (0, float(num_reqs), fixed + self.verify_cost(base, context))
        best_rate, gained = best[1] / max(best[2], 1e-12), 0.0
        for b in range(1, len(slots) + 1):
            gained += slots[b - 1][0]
            seconds = fixed + self.verify_cost(base + round(scale * b), context)
            rate = (num_reqs + scale * gained) / max(seconds, 1e-12)
            if rate > best_rate:
                best, best_rate = (b, num_reqs + scale * gained, seconds), rate
        return best

    def survival(self, features: list[float], num_drafts: int) -> list[float]:
        out, s = [], 1.0
        for k in range(num_drafts):
            s *= self.estimator.predict(k, features[k] if k < len(features) else 0.0)
            out.append(s)
        return out

    def plan(
        self,
        drafts: list[list[int]],
        features: list[list[float]],
        num_tokens_base: int,
        num_requests: int | None = None,
        context: float = 1.0,
        only_explorers: bool = False,
    ) -> Plan:
        """How many drafts of each request to verify next step. `num_tokens_base`: the
        step's tokens without drafts (one per decode, plus any prefill); `num_requests`:
        the requests that gain a token next step, drafting or not (default: those with
        drafts); `context`: the tokens each verified row attends to, on average;
        `only_explorers`: drafting was off and only this step's explorers drafted, so an
        exploring plan verifies all of them (not one in `explore_fraction` of them again)."""
        num_reqs = len(drafts)
        total = max(num_requests if num_requests is not None else num_reqs, num_reqs)
        exploring = self.exploring
        self._count_plan(exploring)
        if self.warming_up:
            return Plan([len(d) for d in drafts], float("nan"), float("nan"))
        slots = [
            (s, r)
            for r, (d, f) in enumerate(zip(drafts, features))
            for s in self.survival(f, len(d))
        ]
        slots.sort(key=lambda slot: -slot[0])
        # this step's drafts are paid for: verify the slots that raise tokens per second
        best_b, best_tokens, best_seconds = self._best(
            slots, total, num_tokens_base, 0.0, context=context
        )
        # drafting again pays only if a whole speculative step, with every request
        # drafting, beats a plain one; when only some drafted (explorers, n-gram misses)
        # their slots stand in for everyone's, and the draft cost is the whole batch's
        draft_seconds = self.draft_cost(total)
        scale = total / max(num_reqs, 1)
        spec = self._best(slots, total, num_tokens_base, draft_seconds, scale, context)
        plain_rate = total / max(self.verify_cost(num_tokens_base, context), 1e-12)
        spec_rate = spec[1] / max(spec[2], 1e-12)
        pays = spec[0] > 0 and spec_rate > plain_rate
        if pays:
            self.num_empty_plans = 0
            self.interval = self.explore_interval
        else:
            if spec_rate < CLEAR_LOSS * plain_rate:  # far behind: no need to confirm it
                self.num_empty_plans = max(self.num_empty_plans + 1, self.idle_plans)
            else:
                self.num_empty_plans += 1
            if exploring:
                cap = MAX_EXPLORE_BACKOFF * self.explore_interval
                self.interval = min(2 * self.interval, cap)
        admitted = [0] * num_reqs
        for _, r in slots[:best_b]:
            admitted[r] += 1
        if exploring:
            chosen = range(num_reqs) if only_explorers else self.explorers(num_reqs)
            for r in chosen:
                admitted[r] = len(drafts[r])
        self.num_trimmed += len(slots) - sum(admitted)
        return Plan(admitted, best_tokens, best_seconds)
