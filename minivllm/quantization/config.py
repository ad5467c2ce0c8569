"""Which layers are quantized online, with which scheme: `quantization` and `quantization_config`.

vLLM v0.30's targeted online quantization (PR #51285), in our words:

- `quantization="int8" | "int4" | "fp8"` (or a scheme id such as "int8_w8a8") quantizes
  every linear layer but the LM head, and every MoE layer's routed experts, with one
  scheme, minus those `ignore` lists.
- `quantization="online"` with `quantization_config={"targets": {pattern: scheme},
  "ignore": [patterns]}` quantizes only the targeted layers. A pattern is an exact
  module name, `re:REGEX` (Python `re.match`: anchored at the start only), or else an
  fnmatch glob. A layer matching `ignore` and a target, or two targets, is an error.
- Fused layers (`qkv_proj`, `gate_up_proj`) are matched by their own name first; else
  each checkpoint shard (`q_proj`, `k_proj`, `v_proj`) must match exactly one target
  and all shards the same scheme, or the model is refused.
- The LM head and the token embedding are quantized only by a pattern that names them
  (contains "lm_head" / "embed_tokens"): catch-alls such as "*" cover the linear layers
  and routed experts, as vLLM's targets cover `LinearBase` and routed experts only. A MoE layer's experts
  are one fused layer (`...mlp.experts`) whose shards are every expert's checkpoint
  projections (`...mlp.experts.7.up_proj`).

`kernel_config={"linear_backend_per_quant": {scheme: backend}}` (PR #51204) picks the
op per scheme: "cpu_kernel" (our C++ kernels) or "torch" (the plain-PyTorch reference).
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass, field
from typing import Any

from minivllm.utils.json_config import config_dict

SCHEMES = ("int8_w8a16", "int8_w8a8", "int4_w4a16", "int4_w4a8", "fp8_w8a16")
INT4_SCHEMES = ("int4_w4a16", "int4_w4a8")  # the same weights; w4a8 rounds x to int8 too
SHORTHANDS = {"int8": "int8_w8a16", "int4": "int4_w4a16", "fp8": "fp8_w8a16"}
QUANTIZATION_METHODS = ("online", *SHORTHANDS, *SCHEMES)
BACKENDS = ("cpu_kernel", "torch")
# names only an explicit pattern reaches (see the module docstring)
EXPLICIT_ONLY = ("lm_head", "embed_tokens")
_CONFIG_KEYS = {"targets", "ignore", "group_size", "symmetric"}
_TARGET_KEYS = {"scheme", "group_size", "symmetric"}


@dataclass(frozen=True)
class SchemeSpec:
    """One scheme with its options; int4 groups along the input dimension."""

    scheme: str
    group_size: int = 128
    symmetric: bool = True

    def __str__(self) -> str:
        if self.scheme not in INT4_SCHEMES:
            return self.scheme
        return f"{self.scheme} (group {self.group_size}, {'' if self.symmetric else 'a'}symmetric)"


@dataclass(frozen=True)
class Target:
    pattern: str
    spec: SchemeSpec


@dataclass(frozen=True)
class QuantizationConfig:
    """The resolved online quantization: what each layer gets, and which op runs each scheme.

    `targets` empty means no online quantization (a pre-quantized checkpoint alone, or
    only backends chosen)."""

    method: str
    targets: tuple[Target, ...] = ()
    ignore: tuple[str, ...] = ()
    backends: dict[str, str] = field(default_factory=dict)
    # a shorthand's one catch-all target: `ignore` carves layers out of it, where with
    # explicit targets a layer in both is an error
    ignore_excludes: bool = False

    def to_json(self) -> str:
        """A stable text of everything that changes the processed weights (the weight cache key)."""
        return json.dumps(
            {
                "method": self.method,
                "targets": [[t.pattern, str(t.spec)] for t in self.targets],
                "ignore": list(self.ignore),
            }
        )

    def spec_for(self, name: str, shards: list[str]) -> tuple[SchemeSpec, str] | None:
        """The scheme of module `name` and the pattern that chose it, or None (full precision).

        `shards` are the checkpoint names a fused module is built from (empty otherwise)."""
        ignored_shards = [self._ignored(s) for s in shards]
        if any(ignored_shards) and not all(ignored_shards):
            raise ValueError(
                f"{name}: `ignore` matches only some of the fused layer's shards {shards}; "
                "one fused weight has one precision: ignore all of them or none"
            )
        ignored = self._ignored(name) or (bool(shards) and all(ignored_shards))
        target = self._match_one(name)
        if shards:  # the shards must agree with a match on the fused name ("*v_proj" hits qkv_proj)
            shared = self._shared_target(name, shards, fused_hit=target)
            if shared is not None:
                if target is not None and shared.spec != target.spec:
                    raise ValueError(
                        f"{name}: the target {target.pattern!r} (on the fused name) and "
                        f"{shared.pattern!r} (on its shards) give different schemes"
                    )
                target = shared
        if target is None or (ignored and self.ignore_excludes):
            return None
        if ignored:
            raise ValueError(f"{name} matches both `ignore` and the target {target.pattern!r}")
        return target.spec, target.pattern

    def spec_for_experts(
        self, name: str, shards: list[str]
    ) -> tuple[tuple[SchemeSpec, str] | None, list[str], list[str]]:
        """The scheme of MoE layer `name`'s routed experts, the target patterns that match
        only some of its experts' projections (`shards`), and the ignore patterns that do.

        vLLM matches routed experts by the MoE layer's name (`...mlp.experts`); we also
        take them when one target covers every expert projection. A pattern written for
        the linear layers (`"*.down_proj"`, as a target or in `ignore`) that happens to
        catch some of the experts' projections is not an error here (it is for
        qkv_proj's shards): the experts stay unquantized and the caller logs the
        patterns. A target on the layer's name is refused if projections are targeted
        with another scheme, and with `ignore` on the layer as for any layer."""
        target = self._match_one(name)
        picks = [self._match_one(s) for s in shards]
        hits = {t for t in picks if t is not None}
        if target is not None:
            clash = sorted(t.pattern for t in hits if t.spec != target.spec)
            if clash:
                raise ValueError(
                    f"{name}: the target {target.pattern!r} gives the routed experts "
                    f"{target.spec}, and {clash} give some of their projections another "
                    "scheme; one MoE layer's experts have one scheme"
                )
        elif hits and None not in picks:
            if len({t.spec for t in hits}) > 1:
                listing = ", ".join(sorted(f"{t.pattern!r}: {t.spec}" for t in hits))
                raise ValueError(
                    f"{name}: the routed experts' projections map to different schemes "
                    f"({listing}); one MoE layer's experts have one scheme"
                )
            (target,) = hits
        ignored_shards = [self._ignored(s) for s in shards]
        ignored = self._ignored(name) or (bool(shards) and all(ignored_shards))
        if ignored:
            if target is not None and not self.ignore_excludes:
                raise ValueError(f"{name} matches both `ignore` and the target {target.pattern!r}")
            return None, [], []
        if any(ignored_shards):  # some projections ignored: the layer keeps full precision
            if target is None and not hits:
                return None, [], []
            caught = [p for p in self.ignore if any(matches(p, s) for s in shards)]
            return None, [], caught
        if target is not None:
            return (target.spec, target.pattern), [], []
        return None, sorted(t.pattern for t in hits), []

    def _shared_target(
        self, name: str, shards: list[str], fused_hit: Target | None = None
    ) -> Target | None:
        """The one target all shards of a fused layer match, None if none matches any."""
        picks = [self._match_one(s) for s in shards]
        if all(p is None for p in picks):
            return None
        if any(p is None for p in picks):
            if fused_hit is not None:
                raise ValueError(
                    f"{name}: the target {fused_hit.pattern!r} matches the fused layer's name "
                    f"but not all its shards ({_describe(shards, picks)}); it would quantize "
                    "the others too: target the shards exactly (e.g. '*.v_proj') or all of them"
                )
            raise ValueError(
                f"{name}: the fused layer's shards {shards} are not all targeted "
                f"({_describe(shards, picks)}); target the fused name or every shard"
            )
        if len({p.spec for p in picks}) > 1:
            raise ValueError(
                f"{name}: the fused layer's shards map to different schemes "
                f"({_describe(shards, picks)}); one fused weight has one scheme"
            )
        return picks[0]

    def _match_one(self, name: str) -> Target | None:
        hits = [t for t in self.targets if matches(t.pattern, name)]
        if len(hits) > 1:
            patterns = ", ".join(repr(t.pattern) for t in hits)
            raise ValueError(
                f"{name} matches more than one target ({patterns}); make them disjoint"
            )
        return hits[0] if hits else None

    def _ignored(self, name: str) -> bool:
        return any(matches(p, name) for p in self.ignore)

    def unused_targets(self, names: list[str]) -> list[str]:
        return [t.pattern for t in self.targets if not any(matches(t.pattern, n) for n in names)]


def _describe(shards: list[str], picks: list[Target | None]) -> str:
    return ", ".join(f"{s}: {p.spec if p else 'none'}" for s, p in zip(shards, picks, strict=True))


def matches(pattern: str, name: str) -> bool:
    """vLLM's pattern rules: `re:` regex (re.match), exact name, else glob; the LM head and
    embedding only by a pattern that names them."""
    if any(part in name for part in EXPLICIT_ONLY) and not any(
        part in pattern for part in EXPLICIT_ONLY if part in name
    ):
        return False
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name or fnmatch.fnmatchcase(name, pattern)


def resolve_quantization(
    quantization: str | None,
    quantization_config: dict[str, Any] | str | None,
    kernel_config: dict[str, Any] | str | None,
) -> QuantizationConfig | None:
    """The user's three arguments, validated, as one `QuantizationConfig` (None: none given)."""
    options = _as_dict(quantization_config, "quantization_config", _CONFIG_KEYS)
    backends = _backends(_as_dict(kernel_config, "kernel_config", {"linear_backend_per_quant"}))
    if quantization is None:
        if options:
            raise ValueError(
                "quantization_config needs quantization='online' (or a shorthand: "
                f"{', '.join(SHORTHANDS)})"
            )
        return QuantizationConfig("none", backends=backends) if backends else None
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(
            f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATION_METHODS)}"
        )
    defaults = {k: options[k] for k in ("group_size", "symmetric") if k in options}
    ignore = _patterns(options.get("ignore", []))
    if quantization == "online":
        raw = options.get("targets")
        if not isinstance(raw, dict) or not raw:
            raise ValueError(
                "quantization='online' needs quantization_config={'targets': {pattern: scheme}}"
            )
        # top-level group_size/symmetric are int4 defaults: other targets ignore them
        targets = tuple(
            Target(_check_pattern(p), _spec(value, defaults, p, int4_only=True))
            for p, value in raw.items()
        )
    else:
        if "targets" in options:
            raise ValueError(
                f"targets go with quantization='online'; {quantization!r} quantizes every linear"
            )
        targets = (Target("*", _spec(quantization, defaults, quantization)),)
    return QuantizationConfig(quantization, targets, ignore, backends, quantization != "online")


def _spec(value: Any, defaults: dict[str, Any], where: str, int4_only: bool = False) -> SchemeSpec:
    if isinstance(value, str):
        value = {"scheme": value}
    if not isinstance(value, dict) or "scheme" not in value:
        raise ValueError(f"target {where!r}: give a scheme name or {{'scheme': ..., ...}}")
    unknown = sorted(set(value) - _TARGET_KEYS)
    if unknown:
        raise ValueError(
            f"target {where!r}: unknown key(s) {unknown}; accepted {sorted(_TARGET_KEYS)}"
        )
    scheme = SHORTHANDS.get(value["scheme"], value["scheme"])
    if scheme not in SCHEMES:
        raise ValueError(
            f"target {where!r}: unknown scheme {value['scheme']!r}; choose one of "
            f"{', '.join(SCHEMES)} or a shorthand ({', '.join(SHORTHANDS)})"
        )
    if int4_only and scheme not in INT4_SCHEMES:
        defaults = {}
    options = {**defaults, **{k: v for k, v in value.items() if k != "scheme"}}
    group_size = options.get("group_size", 128)
    symmetric = options.get("symmetric", True)
    if (
        not isinstance(group_size, int)
        or isinstance(group_size, bool)
        or group_size < 32
        or (group_size % 32)
    ):
        raise ValueError(
            f"target {where!r}: group_size must be a multiple of 32, got {group_size!r}"
        )
    if not isinstance(symmetric, bool):
        raise ValueError(f"target {where!r}: symmetric must be true or false, got {symmetric!r}")
    if scheme not in INT4_SCHEMES and not symmetric:
        raise ValueError(f"target {where!r}: {scheme} is symmetric only")
    return SchemeSpec(scheme, group_size, symmetric)


def _patterns(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ValueError(f"ignore must be a list of patterns, got {value!r}")
    return tuple(_check_pattern(p) for p in value)


def _check_pattern(pattern: Any) -> str:
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"a pattern must be a non-empty string, got {pattern!r}")
    if pattern.startswith("re:"):
        try:
            re.compile(pattern[3:])
        except re.error as exc:
            raise ValueError(
                f"pattern {pattern!r} is not a valid regular expression: {exc}"
            ) from None
    return pattern


def _as_dict(value: dict[str, Any] | str | None, name: str, accepted: set[str]) -> dict[str, Any]:
    return {} if value is None else config_dict(value, name, accepted)


def _backends(kernel_config: dict[str, Any]) -> dict[str, str]:
    per_quant = kernel_config.get("linear_backend_per_quant", {})
    if not isinstance(per_quant, dict):
        raise ValueError("linear_backend_per_quant must map scheme ids to backend names")
    for scheme, backend in per_quant.items():
        if scheme not in SCHEMES:
            raise ValueError(
                f"linear_backend_per_quant: unknown scheme {scheme!r}; choose from {', '.join(SCHEMES)}"
            )
        if backend not in BACKENDS:
            raise ValueError(
                f"linear_backend_per_quant: unknown backend {backend!r} for {scheme}; "
                f"choose from {', '.join(BACKENDS)}"
            )
    return dict(per_quant)
