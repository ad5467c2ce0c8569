"""Detecting the watermark: one module behind the server route, the CLI and `detect()`.

Score the completion's token ids (no prompt, no chat template): position t's context
is the h previous tokens with sentinels before the first, exactly as in generation,
and with deduplication (default) only the first occurrence of each context counts,
since a repeated context repeats its keyed uniforms and is no new evidence.

Single key: s_t = -ln(1 - u_t), u_t = PRF(key, context_t, y_t). Text not generated with
this key gives s_t ~ Exp(1) independently, so S = sum s_t ~ Gamma(n, 1) and the p-value
is the upper tail Q(n, S); watermarked text scores higher because the chosen token
tends to have a large u. Dual key: s_t = (1 - a) s_A + a s_B with a the generation's
alpha; under the null its mean is n and variance n v, v = (1 - a)^2 + a^2, and the
p-value is the moment-matched Gamma's, Q(n / v, S / v) (vLLM's weighted fusion; our
default a equals generation's, unlike vLLM v0.30's detector, #57839). The p-value is
computed in log space (`log10_p_value`), so long texts do not underflow to 0.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from minivllm.watermark.config import WatermarkConfig
from minivllm.watermark.prf import SENTINEL, philox_uniform

DEFAULT_THRESHOLD = 0.01
MAX_SCORED_TOKENS = 1 << 16  # the server's bound; the Python function takes any


@dataclass(frozen=True, slots=True)
class Detection:
    score: float  # S, the sum of per-token scores
    p_value: float  # P(S this large | not watermarked with this key); may underflow to 0
    log10_p_value: float  # never underflows
    z_score: float  # (S - n) / sqrt(n v)
    num_scored_tokens: int  # n, after deduplication
    is_watermarked: bool  # p_value <= threshold

    def to_dict(self) -> dict:
        return asdict(self)


def scored_positions(
    token_ids: list[int], context_width: int, deduplicate: bool = True
) -> tuple[list[tuple[int, ...]], list[int]]:
    """(contexts, tokens) of the positions that count."""
    padded = [SENTINEL] * context_width + list(token_ids)
    seen: set[tuple[int, ...]] = set()
    contexts, tokens = [], []
    for t, token in enumerate(token_ids):
        context = tuple(padded[t : t + context_width])
        if deduplicate:
            if context in seen:
                continue
            seen.add(context)
        contexts.append(context)
        tokens.append(token)
    return contexts, tokens


def token_scores(key: int, contexts: list[tuple[int, ...]], tokens: list[int]) -> torch.Tensor:
    """-ln(1 - u) per scored position (float64)."""
    if not tokens:
        return torch.zeros(0, dtype=torch.float64)
    u = philox_uniform(
        key, torch.tensor(contexts, dtype=torch.int64), torch.tensor(tokens).unsqueeze(1)
    )
    return -torch.log1p(-u.squeeze(1).double())


def detect(
    token_ids: list[int],
    config: WatermarkConfig,
    threshold: float = DEFAULT_THRESHOLD,
    deduplicate: bool = True,
    alpha: float | None = None,
    max_tokens: int | None = None,
) -> Detection:
    """Whether `token_ids` (a completion) carry `config`'s watermark. `alpha` (dual key
    only) defaults to the config's, i.e. generation's; `max_tokens` scores only the first
    that many distinct contexts."""
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"the p-value threshold must be in (0, 1), got {threshold}")
    contexts, tokens = scored_positions(token_ids, config.context_width, deduplicate)
    if max_tokens is not None:
        contexts, tokens = contexts[:max_tokens], tokens[:max_tokens]
    n = len(tokens)
    if n == 0:
        return Detection(0.0, 1.0, 0.0, 0.0, 0, False)
    if config.algorithm == "dual_key_gumbel":
        a = config.alpha if alpha is None else alpha
        key_a, key_b = config.sub_keys
        scores = (1 - a) * token_scores(key_a, contexts, tokens)
        scores += a * token_scores(key_b, contexts, tokens)
        variance = (1 - a) ** 2 + a**2
    else:
        scores, variance = token_scores(config.key, contexts, tokens), 1.0
    total = float(scores.sum())
    log_p = log_gamma_upper_regularized(n / variance, total / variance)
    log10_p = log_p / math.log(10)
    p_value = math.exp(log_p)
    return Detection(
        score=total,
        p_value=p_value,
        log10_p_value=log10_p,
        z_score=(total - n) / math.sqrt(n * variance),
        num_scored_tokens=n,
        is_watermarked=log_p <= math.log(threshold),
    )


def log_gamma_upper_regularized(a: float, x: float) -> float:
    """ln Q(a, x) = ln(Gamma(a, x) / Gamma(a)) for a > 0, x >= 0, accurate in the far tail.

    Below x = a + 1 the lower series is summed and Q = 1 - P; above, Q's continued
    fraction is evaluated by the modified Lentz method (the classical split, as in
    Press et al., Numerical Recipes, ch. 6.2), all with the prefactor in log space."""
    if x <= 0.0:
        return 0.0
    log_prefactor = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1.0:
        term = total = 1.0 / a
        denom = a
        for _ in range(100_000):
            denom += 1.0
            term *= x / denom
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        lower = math.exp(log_prefactor + math.log(total))
        return math.log1p(-min(lower, 1.0)) if lower < 1.0 else -math.inf
    tiny = 1e-300
    b = x + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 100_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return log_prefactor + math.log(h)
