"""Checkpoints that store some layers quantized, in the compressed-tensors format.

That is what llm-compressor writes and vLLM loads: config.json carries a
`quantization_config` with `quant_method: "compressed-tensors"`, `config_groups`
(each: `targets` (module class names such as "Linear", or `re:` module-name regexes),
`weights` and `input_activations` quantization arguments) and `ignore` (modules left
in full precision). The on-disk tensors of a quantized layer, per format:

- int-, naive- or float-quantized (int8 W8A8; fp8 e4m3 per channel): `weight` int8
  or float8_e4m3fn [N, K] and `weight_scale` [N, 1]; w = q * scale. int4 W4A8 is
  int-quantized too: `weight` int8 [N, K] holding q in [-8, 7], `weight_scale` [N, K/G],
  and when asymmetric `weight_zero_point` int8 [N, K/G], unpacked.
- pack-quantized (every int weight-only scheme, int8 included): `weight_packed` int32
  [N, K*b/32] (element i in bits [i*b, i*b+b) of the words, stored as q + 2^(b-1)),
  `weight_scale` [N, 1] (per channel) or [N, K/G] (int4 groups), `weight_shape` [2];
  asymmetric int4 adds `weight_zero_point`, packed the same way but down the output
  dimension (int32 [N/8, K/G]); w = (q - z) * scale.
- Symmetric int8 scales are max|w|/127.5 there, so q reaches -128 (our kernels take it).

A `kv_cache_scheme` (fp8 keys and values with calibrated per-layer or per-head scales)
is read by quantization/kv_cache.py; a checkpoint may hold only that.

Layers the checkpoint stores quantized keep that format (repacked once into our
kernel layout, `formats.py`, never re-quantized); online `targets` (config.py) apply
only to the layers left in full precision (vLLM PR #51392). `tests/compressed_tensors_utils.py`
builds such checkpoints with the compressed-tensors library itself.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from minivllm.quantization.config import SchemeSpec
from minivllm.quantization.kv_cache_scheme import KVCacheScheme, read_kv_cache_scheme

_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
_SUPPORTED = (
    "int8 weights per channel (symmetric), activations unquantized or dynamic per-token int8; "
    "int4 weights in groups, activations unquantized or dynamic per-token int8; "
    "fp8 e4m3 weights per channel, per tensor or in blocks, activations unquantized or fp8 "
    "(run unquantized)"
)


@dataclass(frozen=True)
class StoredScheme:
    """A scheme as the checkpoint stores it: `format` says how its tensors are laid out;
    `per_tensor`: one weight scale per checkpoint tensor (fp8), not per channel;
    `unused_activations`: activation quantization the checkpoint names and we skip."""

    spec: SchemeSpec
    format: str
    per_tensor: bool = False
    unused_activations: str = ""
    block: tuple[int, int] | None = None  # fp8: a scale per block of (rows, k)
    scale_name: str = "weight_scale"

    def __str__(self) -> str:
        scale = ", one scale per tensor" if self.per_tensor else ""
        if self.block:
            scale = f", a scale per {self.block[0]}x{self.block[1]} block"
        if not self.unused_activations:
            return f"{self.spec}{scale}"
        return f"{self.spec}{scale}; the checkpoint's {self.unused_activations} run unquantized"


@dataclass(frozen=True)
class ConfigGroup:
    targets: tuple[str, ...]
    stored: StoredScheme


@dataclass(frozen=True)
class CheckpointQuantization:
    """Which layers a compressed-tensors checkpoint stores quantized, and how."""

    groups: tuple[ConfigGroup, ...]
    ignore: tuple[str, ...]
    format: str = "compressed-tensors"
    kv_cache: KVCacheScheme | None = None  # fp8 KV-cache scales (quantization/kv_cache.py)

    def spec_for(self, name: str, shards: list[str]) -> StoredScheme | None:
        """The stored scheme of our module `name` (a fused module: of its checkpoint
        shards, which must agree), or None if the checkpoint stores it unquantized."""
        if not shards:
            return self._stored(name)
        stored = [self._stored(s) for s in shards]
        if len(set(stored)) > 1:
            # one example shard per way of storing (a MoE layer has 3 per expert)
            kinds: dict[StoredScheme | None, list[str]] = {}
            for shard, how in zip(shards, stored, strict=True):
                kinds.setdefault(how, []).append(shard)
            listing = ", ".join(
                f"{same[0]}{f' and {len(same) - 1} more' if len(same) > 1 else ''}: "
                f"{how or 'unquantized'}"
                for how, same in kinds.items()
            )
            raise ValueError(
                f"{name}: the checkpoint stores the shards of this fused layer differently "
                f"({listing}); minivllm fuses them into one weight"
            )
        return stored[0]

    def _stored(self, name: str) -> StoredScheme | None:
        if _matches_any(self.ignore, name):
            return None
        for group in self.groups:
            if _matches_any(group.targets, name):
                return group.stored
        return None

    def method_for(self, stored: StoredScheme, backend: str | None):
        from minivllm.quantization.ct_method import CompressedTensorsLinearMethod

        return CompressedTensorsLinearMethod(
            stored.spec,
            backend,
            stored.format,
            stored.per_tensor,
            stored.block,
            stored.scale_name,
        )


def _matches_any(patterns: tuple[str, ...], name: str) -> bool:
    """compressed-tensors' matching of any of `patterns`: `re:` regex (re.match) or an
    exact module name; the class name "Linear" covers every linear layer and the LM head
    (HF's are nn.Linear). An fp8 checkpoint's `modules_to_not_convert` can list hundreds
    of modules, each matched against every linear and every routed expert's projection
    (3 per expert per layer): `_matcher` compiles them once."""
    return _matcher(patterns)(name)


@functools.lru_cache(maxsize=64)
def _matcher(patterns: tuple[str, ...]) -> Callable[[str], bool]:
    """One regex for the patterns that can share it (no groups, so no backreferences to
    renumber, and no inline flags, which would spread to the others); the rest each on
    its own. A pattern that does not compile is an error naming it."""
    linear = "Linear" in patterns
    plain = re.compile("").flags
    shared, alone = [], []
    for p in patterns:
        if p == "Linear":
            continue
        text = p[3:] if p.startswith("re:") else re.escape(p) + r"\Z"
        try:
            compiled = re.compile(text)
        except re.error as exc:
            raise ValueError(
                f"the checkpoint's module pattern {p!r} is not a valid regex: {exc}"
            ) from None
        if compiled.groups == 0 and compiled.flags == plain:
            shared.append(text)
        else:
            alone.append(compiled)
    if shared:
        alone.append(re.compile("|".join(f"(?:{t})" for t in shared)))

    def match(name: str) -> bool:
        if linear and "embed_tokens" not in name:
            return True
        return any(r.match(name) for r in alone)

    return match


def read_checkpoint_quantization(hf_config: Any) -> CheckpointQuantization | None:
    """The checkpoint's own quantization from its config, or None; a method or scheme we do
    not load is an error naming it (never a silent full-precision load of packed weights)."""
    quant = getattr(hf_config, "quantization_config", None)
    if not quant:
        return None
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    method = quant.get("quant_method")
    if method == "fp8":
        from minivllm.quantization.hf_fp8 import read_fp8_checkpoint

        return read_fp8_checkpoint(quant)
    if method != "compressed-tensors":
        raise ValueError(
            f"checkpoints quantized with {method!r} are not supported; minivllm loads "
            "compressed-tensors checkpoints (llm-compressor), transformers' fp8 checkpoints "
            "and quantizes online "
            "(--quantization int8/int4/fp8)"
        )
    groups = []
    for name, group in (quant.get("config_groups") or {}).items():
        fmt = str(group.get("format") or quant.get("format") or "naive-quantized")
        if fmt not in _FORMATS:
            raise ValueError(
                f"compressed-tensors group {name!r} uses the {fmt!r} format; minivllm loads "
                f"{', '.join(_FORMATS)}"
            )
        targets = group.get("targets") or ()
        odd = [t for t in targets if not (t.startswith("re:") or t == "Linear" or "." in t)]
        if odd:
            raise ValueError(
                f"compressed-tensors group {name!r} targets {odd}: minivllm matches the class "
                "name 'Linear', module names and 're:' patterns"
            )
        stored = _stored_scheme(name, group, fmt)
        groups.append(ConfigGroup(tuple(group.get("targets") or ()), stored))
    kv_cache = read_kv_cache_scheme(quant)
    if not groups and kv_cache is None:
        raise ValueError(
            "the checkpoint's compressed-tensors config has no config_groups and no kv_cache_scheme"
        )
    return CheckpointQuantization(
        tuple(groups), tuple(quant.get("ignore") or ()), kv_cache=kv_cache
    )


def _stored_scheme(name: str, group: dict[str, Any], fmt: str) -> StoredScheme:
    """The group's scheme. fp8 weights with fp8 activations (llm-compressor's FP8_DYNAMIC:
    per channel, activations per token; its FP8: per tensor, static activation scales)
    run as fp8_w8a16, as vLLM runs them on GPUs without fp8 arithmetic (weight-only,
    Marlin): the activations keep the engine's dtype, closer to the unquantized model
    than the checkpoint's own fp8 rounding, and the static `input_scale`s go unused."""
    weights = group.get("weights") or {}
    acts = group.get("input_activations")
    fp8_acts = (
        isinstance(acts, dict)
        and acts.get("num_bits") == 8
        and acts.get("type") == "float"
        and acts.get("symmetric", True)
        and (
            (acts.get("strategy") in ("token", "group") and acts.get("dynamic") is True)
            or (acts.get("strategy") == "tensor" and acts.get("dynamic") is False)
        )
    )
    strategy = weights.get("strategy")
    if (
        weights.get("type") == "float"
        and weights.get("num_bits") == 8
        and weights.get("symmetric", True)
        and strategy in ("channel", "tensor", "block")
        and (acts is None or fp8_acts)
    ):
        unused = ""
        if fp8_acts:
            dynamic = {"token": "dynamic, per token", "group": "dynamic, per group"}
            unused = f"fp8 activations ({dynamic.get(acts.get('strategy'), 'static scales')})"
        block = None
        if strategy == "block":  # FP8_BLOCK: a scale per block of weight rows and k
            where = f"compressed-tensors group {name!r}'s block_structure"
            block = block_structure(where, weights.get("block_structure"))
        return StoredScheme(SchemeSpec("fp8_w8a16"), fmt, strategy == "tensor", unused, block)
    return StoredScheme(_scheme_of(name, group), fmt)


def block_structure(where: str, value: Any) -> tuple[int, int]:
    """fp8 block dimensions [rows, k]; `where` names their source in the error."""
    if (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, int) and v > 0 for v in value)
        and value[1] % 16 == 0
    ):
        return int(value[0]), int(value[1])
    raise ValueError(f"{where}: fp8 blocks {value!r} are not [rows, k] with k a multiple of 16")


def _scheme_of(name: str, group: dict[str, Any]) -> SchemeSpec:
    weights = group.get("weights") or {}
    acts = group.get("input_activations")
    bits, kind = weights.get("num_bits"), weights.get("type", "int")
    strategy, symmetric = weights.get("strategy"), weights.get("symmetric", True)
    dynamic_token_int8 = (
        isinstance(acts, dict)
        and acts.get("num_bits") == 8
        and acts.get("type", "int") == "int"
        and acts.get("strategy") == "token"
        and acts.get("dynamic") is True
        and acts.get("symmetric", True)
    )
    if kind == "int" and bits == 8 and strategy == "channel" and symmetric:
        if acts is None:
            return SchemeSpec("int8_w8a16")
        if dynamic_token_int8:
            return SchemeSpec("int8_w8a8")
    if kind == "int" and bits == 4 and strategy == "group" and (acts is None or dynamic_token_int8):
        group_size = weights.get("group_size")
        if isinstance(group_size, int) and group_size >= 32 and group_size % 32 == 0:
            # W4A8 (llm-compressor's preset: int8 activations per token) runs as our
            # int4_w4a8, whose activation scales are per token and weight group: finer
            # than the checkpoint asks, at no cost to the kernel (formats.quantize_per_group)
            scheme = "int4_w4a16" if acts is None else "int4_w4a8"
            return SchemeSpec(scheme, group_size, bool(symmetric))
    raise ValueError(
        f"compressed-tensors group {name!r} uses a scheme minivllm does not load (weights "
        f"{bits}-bit {kind} {strategy}, symmetric={symmetric}, activations {acts}); "
        f"supported: {_SUPPORTED}"
    )
