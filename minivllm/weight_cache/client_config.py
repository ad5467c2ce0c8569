"""The engine's weight-cache options: `model_loader_extra_config` with `load_format="ipc_cache"`."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

MODES = ("zero_copy", "copy")


@dataclass(frozen=True, slots=True)
class WeightCacheClientConfig:
    """`mode`: zero_copy maps the daemon's memory (it must outlive the engine); copy clones
    it and tells the daemon to release. `fallback`: load from disk when the daemon is
    unreachable or holds other weights (False: raise; wait up to `state_timeout_s`)."""

    mode: str = "zero_copy"
    fallback: bool = True
    socket_dir: str | None = None
    socket_path: str | None = None
    connect_timeout_s: float = 5.0
    state_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"model_loader_extra_config.mode must be one of {MODES}")
        if not isinstance(self.fallback, bool):
            raise ValueError("model_loader_extra_config.fallback must be true or false")
        for name in ("socket_dir", "socket_path"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"model_loader_extra_config.{name} must be a path")
        for name in ("connect_timeout_s", "state_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"model_loader_extra_config.{name} must be a number > 0")

    @classmethod
    def from_value(cls, value: dict[str, Any] | str | None) -> WeightCacheClientConfig:
        """From a dict or its JSON text (`--model-loader-extra-config`); unknown keys are errors."""
        if value is None:
            return cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"model_loader_extra_config is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("model_loader_extra_config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"unknown model_loader_extra_config key(s) {unknown}; accepted: {sorted(known)}"
            )
        return cls(**value)
