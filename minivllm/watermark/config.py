"""`watermark_config`: vLLM's fields and defaults, validated before any model loads."""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field, fields
from typing import Any

from minivllm.utils.json_config import config_dict

logger = logging.getLogger("minivllm")

ALGORITHMS = ("gumbel", "dual_key_gumbel")
DEDUPLICATION = ("single_turn", "none", "all")
PRFS = ("philox",)
MAX_CONTEXT_WIDTH = 64


@dataclass(frozen=True)
class WatermarkConfig:
    """Keyed Gumbel-max watermarking of sampled tokens (`docs/watermarking.md`).

    - `key` (required): the secret, 0 <= key < 2^64. Never printed, logged or returned;
      `key_file` (a file holding the integer) or `key_env` (an environment variable's
      name) keep it out of process lists and shell history instead.
    - `algorithm`: `gumbel` (one key) or `dual_key_gumbel` (sub-keys A and B; each token
      uses B with probability `alpha`; under speculative decoding drafts use A and
      recovery/bonus tokens B).
    - `alpha` (0.1): the probability of key B, and the detector's fusion weight.
    - `context_width` h (4): the previous generated tokens that key each draw.
    - `deduplicate_contexts`: `single_turn` (default: a context already seen in this
      request's output is sampled unwatermarked), `none`, or `all` (the prompt is
      searched too, and the first h tokens are not watermarked).
    - `deduplicate_contexts_max_history` (8192): how many recent positions are searched
      (None: all).
    - `prf`: `philox` (vLLM's philox4x32-10-v1 mapping).
    - `allow_target_only_watermarking` (false): with speculative decoding and plain
      `gumbel`, watermark only recovery and bonus tokens instead of refusing to start.
    """

    key: int = field(repr=False)
    algorithm: str = "gumbel"
    alpha: float = 0.1
    context_width: int = 4
    deduplicate_contexts: str = "single_turn"
    deduplicate_contexts_max_history: int | None = 8192
    prf: str = "philox"
    allow_target_only_watermarking: bool = False

    def __post_init__(self) -> None:
        key = self.key
        if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < 2**64:
            raise ValueError("watermark_config.key must be an integer with 0 <= key < 2**64")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(
                f"watermark_config.algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}"
            )
        alpha = self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
            raise ValueError(f"watermark_config.alpha must be in [0, 1], got {alpha!r}")
        h = self.context_width
        if isinstance(h, bool) or not isinstance(h, int) or not 1 <= h <= MAX_CONTEXT_WIDTH:
            raise ValueError(
                f"watermark_config.context_width must be an integer in [1, {MAX_CONTEXT_WIDTH}], "
                f"got {h!r}"
            )
        if self.deduplicate_contexts not in DEDUPLICATION:
            raise ValueError(
                f"watermark_config.deduplicate_contexts must be one of {DEDUPLICATION}, "
                f"got {self.deduplicate_contexts!r}"
            )
        history = self.deduplicate_contexts_max_history
        if history is not None and (
            isinstance(history, bool) or not isinstance(history, int) or history < 1
        ):
            raise ValueError(
                "watermark_config.deduplicate_contexts_max_history must be a positive integer "
                f"or null, got {history!r}"
            )
        if self.prf not in PRFS:
            raise ValueError(f"watermark_config.prf must be one of {PRFS}, got {self.prf!r}")
        if not isinstance(self.allow_target_only_watermarking, bool):
            raise ValueError("watermark_config.allow_target_only_watermarking must be a boolean")

    def warn_about_weak_settings(self) -> None:
        if self.context_width > 16:
            logger.warning(
                "watermark context_width %d: every edit of the text breaks %d contexts",
                self.context_width,
                self.context_width,
            )
        if self.deduplicate_contexts == "none":
            logger.warning(
                "watermark deduplicate_contexts 'none': repeated contexts reuse the same random "
                "draw, which makes repetition loops likelier"
            )
        history = self.deduplicate_contexts_max_history
        if history is not None and history < 1024:
            logger.warning(
                "watermark deduplicate_contexts_max_history %d misses loops whose contexts "
                "recur further apart",
                history,
            )

    @property
    def sub_keys(self) -> tuple[int, int]:
        """Dual-key sub-keys A and B: the first 8 bytes (big-endian) of
        SHA-256(b"key_a" or b"key_b" + the key as 8 big-endian bytes)."""
        raw = self.key.to_bytes(8, "big")
        return tuple(
            int.from_bytes(hashlib.sha256(domain + raw).digest()[:8], "big")
            for domain in (b"key_a", b"key_b")
        )

    @classmethod
    def from_value(
        cls, value: WatermarkConfig | dict[str, Any] | str | None
    ) -> WatermarkConfig | None:
        """From a dict (`LLM(watermark_config={...})`) or JSON (`--watermark-config`). The key
        may be given as `key`, `key_file` or `key_env` (exactly one)."""
        if value is None or isinstance(value, WatermarkConfig):
            return value
        accepted = {f.name for f in fields(cls)} | {"key_file", "key_env"}
        value = config_dict(value, "watermark_config", accepted)
        value["key"] = _read_key(value, value.pop("key_file", None), value.pop("key_env", None))
        return cls(**value)


def _read_key(value: dict, key_file: str | None, key_env: str | None) -> int:
    given = [
        name
        for name, v in (("key", value.get("key")), ("key_file", key_file), ("key_env", key_env))
        if v is not None
    ]
    if len(given) != 1:
        raise ValueError(
            "watermark_config needs exactly one of 'key', 'key_file' (a file holding the "
            f"integer key) or 'key_env' (an environment variable holding it); got {given or 'none'}"
        )
    if key_file is not None:
        try:
            with open(key_file, encoding="utf-8") as f:
                text = f.read().strip()
        except OSError as exc:
            raise ValueError(f"watermark_config.key_file cannot be read: {exc.strerror}") from None
        return _parse_key(text, "the key file")
    if key_env is not None:
        text = os.environ.get(key_env)
        if text is None:
            raise ValueError(
                f"watermark_config.key_env: the environment variable {key_env} is not set"
            )
        return _parse_key(text.strip(), f"${key_env}")
    key = value["key"]
    return _parse_key(key, "key") if isinstance(key, str) else key


def _parse_key(text: str, where: str) -> int:
    try:  # decimal (leading zeros allowed), else 0x/0o/0b
        return int(text, 10) if text.strip().isdigit() else int(text, 0)
    except ValueError:
        # never echo the text: it may be the secret with a typo
        raise ValueError(f"watermark_config: {where} does not hold an integer key") from None
