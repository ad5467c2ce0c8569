"""`speculative_config`: vLLM's fields, validated before any model loads."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from minivllm.utils.json_config import config_dict

METHODS = ("ngram", "draft_model", "eagle")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
REJECTION_SAMPLE_METHODS = ("standard", "synthetic")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """How to draft and verify tokens (vLLM's `--speculative-config` fields and defaults).

    - `method`: `ngram` (prompt lookup over the request's own tokens), `draft_model`
      (a small model with the target's vocabulary, named by `model`) or `eagle` (an
      EAGLE-1 head trained on the target's hidden states, named by `model`).
    - `num_speculative_tokens` (k): drafts per request per step.
    - `prompt_lookup_min` / `prompt_lookup_max`: n-gram lengths searched (max required).
    - `draft_sample_method`: `greedy` drafts are the draft's argmax (verification treats
      them as one-hot); `probabilistic` samples them and keeps the draft distribution,
      so recovery draws from max(p - q, 0).
    - `rejection_sample_method`: `standard` (exact: the output distribution is the
      target's), or `synthetic`, a benchmarking mode accepting draft position i with
      probability `synthetic_acceptance_rates[i]` whatever the draft says.
    - `enable_adaptive_verification`: verify only the drafts whose estimated acceptance
      pays for their verification cost (`spec_decode/adaptive.py`).
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    draft_sample_method: str = "greedy"
    rejection_sample_method: str = "standard"
    synthetic_acceptance_rates: tuple[float, ...] | None = None
    enable_adaptive_verification: bool = False

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {METHODS}, got {self.method!r}"
            )
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be an integer in "
                f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        if self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(
                f"speculative_config.draft_sample_method must be one of {DRAFT_SAMPLE_METHODS}, "
                f"got {self.draft_sample_method!r}"
            )
        if self.rejection_sample_method not in REJECTION_SAMPLE_METHODS:
            raise ValueError(
                f"speculative_config.rejection_sample_method must be one of "
                f"{REJECTION_SAMPLE_METHODS}, got {self.rejection_sample_method!r}"
            )
        self._check_method_fields()
        self._check_synthetic()

    def _check_method_fields(self) -> None:
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min or 1, self.prompt_lookup_max
            if hi is None:
                raise ValueError(
                    "speculative_config.prompt_lookup_max is required for method 'ngram'"
                )
            if not (isinstance(hi, int) and isinstance(lo, int) and 1 <= lo <= hi):
                raise ValueError(
                    "speculative_config.prompt_lookup_min and prompt_lookup_max must be integers "
                    f"with 1 <= min <= max, got {self.prompt_lookup_min!r} and {hi!r}"
                )
            if self.model is not None:
                raise ValueError("speculative_config.model is not used by method 'ngram'; drop it")
            if self.draft_sample_method == "probabilistic":
                raise ValueError(
                    "speculative_config.draft_sample_method 'probabilistic' needs a draft "
                    "distribution, which method 'ngram' does not have; use 'greedy'"
                )
        elif not self.model:
            bundled = "demo-draft" if self.method == "draft_model" else "demo-eagle"
            raise ValueError(
                f"speculative_config.model is required for method {self.method!r} (a checkpoint "
                f"directory or a bundled name such as {bundled!r})"
            )

    def _check_synthetic(self) -> None:
        rates = self.synthetic_acceptance_rates
        if self.rejection_sample_method != "synthetic":
            if rates is not None:
                raise ValueError(
                    "speculative_config.synthetic_acceptance_rates needs "
                    "rejection_sample_method 'synthetic'"
                )
            return
        if rates is None or len(rates) != self.num_speculative_tokens:
            raise ValueError(
                "speculative_config.synthetic_acceptance_rates must give one rate per draft "
                f"position ({self.num_speculative_tokens}), got {rates!r}"
            )
        if any(not 0.0 <= r <= 1.0 for r in rates):
            raise ValueError(
                f"speculative_config.synthetic_acceptance_rates must lie in [0, 1], got {rates!r}"
            )

    @property
    def prompt_lookup_range(self) -> tuple[int, int]:
        return self.prompt_lookup_min or 1, self.prompt_lookup_max or 0

    @classmethod
    def from_value(
        cls, value: SpeculativeConfig | dict[str, Any] | str | None
    ) -> SpeculativeConfig | None:
        """From a dict (`LLM(speculative_config={...})`) or a JSON string (`--speculative-config`)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = config_dict(value, "speculative_config", {f.name for f in fields(cls)})
        if "method" not in value or "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs 'method' and 'num_speculative_tokens'")
        if value.get("synthetic_acceptance_rates") is not None:
            value["synthetic_acceptance_rates"] = tuple(
                float(r) for r in value["synthetic_acceptance_rates"]
            )
        return cls(**value)
