"""The dict-or-JSON config values (`speculative_config`, `watermark_config`), read one way."""

from __future__ import annotations

import json
from typing import Any


def config_dict(value: dict[str, Any] | str, name: str, accepted: set[str]) -> dict[str, Any]:
    """`value` as a fresh dict (parsed if it is JSON text); unknown fields are an error that
    lists the accepted ones."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON: {exc.msg}") from None
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a dict or JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - accepted)
    if unknown:
        raise ValueError(
            f"unknown {name} field(s): {', '.join(unknown)}; "
            f"accepted: {', '.join(sorted(accepted))}"
        )
    return dict(value)
