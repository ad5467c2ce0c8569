"""`SamplingParams`: vLLM's per-request generation knobs, validated once."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
MAX_GRAMMAR_CHARS = 64 * 1024  # a schema, regex or grammar larger than this is refused
MAX_CHOICES = 1024


@dataclass
class StructuredOutputsParams:
    """What a constrained request must produce (vLLM's `StructuredOutputsParams`); set
    exactly one of: `json` (a JSON schema, as a dict or its text), `json_object` (any
    JSON object), `regex`, `choice` (one of these strings), `grammar` (EBNF, as
    xgrammar reads it)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [
            name
            for name in ("json", "regex", "choice", "grammar", "json_object")
            if getattr(self, name) not in (None, False)
        ]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object; got {given or 'none'}"
            )
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise TypeError("structured_outputs.json must be a JSON schema (an object)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if (
                not isinstance(self.choice, list)
                or not 0 < len(self.choice) <= MAX_CHOICES
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise ValueError(
                    f"structured_outputs.choice must be a list of 1..{MAX_CHOICES} non-empty strings"
                )
        if self.json_object not in (None, True, False):
            raise TypeError("structured_outputs.json_object must be a bool")
        if len(self.key()[1]) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"structured_outputs is longer than {MAX_GRAMMAR_CHARS} characters")

    def key(self) -> tuple[str, str]:
        """(kind, text): what the grammar backend compiles and caches by."""
        if self.json is not None:
            return "json", json.dumps(self.json, sort_keys=True)
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        return "grammar", self.grammar


@dataclass
class SamplingParams:
    """How to sample one request's continuation (vLLM's fields, meanings and defaults).

    `temperature=0` means greedy. `logprobs=k` returns the top-k log-probabilities
    of the model's raw distribution (plus the sampled token) at each step;
    `prompt_logprobs=k` does the same for every prompt position after the first.
    `watermarking=False` opts this request out of the engine's watermark (None or True:
    watermarked when the engine has a `watermark_config`; a server started with
    `--watermark-enforce` refuses the opt-out). `structured_outputs` constrains the
    output to a JSON schema, regex, choice or grammar (`StructuredOutputsParams`).
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    watermarking: bool | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Resolved by the engine: EOS ids from the model's generation config.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list("stop", self.stop)
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids)
        if self.top_k is None or (type(self.top_k) is int and self.top_k == -1):
            self.top_k = 0  # vLLM accepts -1 for "off"
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        self._validate()
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _validate(self) -> None:
        _check_int("n", self.n, 1, 128)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, None, low_open=True)
        _check_range("temperature", self.temperature, 0.0, None)
        _check_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, 0, None)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, -(2**63), 2**63 - 1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, None)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, 0, MAX_LOGPROBS)
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop[{i}] must be a non-empty string, got {s!r}")
        for i, t in enumerate(self.stop_token_ids):
            _check_int(f"stop_token_ids[{i}]", t, 0, None)
        for name in (
            "ignore_eos",
            "detokenize",
            "skip_special_tokens",
            "include_stop_str_in_output",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.watermarking is not None and not isinstance(self.watermarking, bool):
            raise TypeError(f"watermarking must be a bool or None, got {self.watermarking!r}")
        for token_id, bias in (self.logit_bias or {}).items():
            _check_range(f"logit_bias[{token_id}]", bias, -100.0, 100.0)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise TypeError("structured_outputs must be a StructuredOutputsParams")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        """Whether repetition, frequency or presence penalties change the logits."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @property
    def max_stop_str_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def clone(self) -> SamplingParams:
        return SamplingParams(**{k: getattr(self, k) for k in _INIT_FIELDS})


_INIT_FIELDS = [f for f in SamplingParams.__dataclass_fields__ if f != "all_stop_token_ids"]


def _as_list(name: str, value: object) -> list:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list, got {type(value).__name__}")
    return list(value)


def _logit_bias(value: object) -> dict[int, float]:
    """Token id -> bias; ids may come as integer strings (JSON object keys)."""
    if not isinstance(value, dict):
        raise TypeError(
            f"logit_bias must be a dict of token id to bias, got {type(value).__name__}"
        )
    bias = {}
    for key, v in value.items():
        try:
            token_id = int(key) if isinstance(key, str) else key
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids, got {key!r:.40}") from None
        _check_int("logit_bias key", token_id, 0, None)
        _check_range(f"logit_bias[{token_id}]", v, -100.0, 100.0)
        bias[token_id] = float(v)
    return bias


def _check_int(name: str, value: object, low: int | None, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    _check_range(name, value, low, high)


def _check_range(
    name: str, value: object, low: float | None, high: float | None, low_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and value > high
    if too_low or too_high or value != value:  # value != value catches NaN
        left = "(" if low_open else "["
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        raise ValueError(f"{name} must be in {left}{lo}, {hi}], got {value!r}")
