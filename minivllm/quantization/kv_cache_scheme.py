"""A compressed-tensors checkpoint's `kv_cache_scheme`, without torch (read while the
engine's arguments resolve; `serve --help` imports no torch): what it declares, what
`kv_cache_dtype="auto"` becomes for it, and which checkpoint tensors are its scales.
The scales themselves are loaded and applied by quantization/kv_cache.py."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("minivllm")

STRATEGIES = ("tensor", "attn_head")

# checkpoint leaf names (under `self_attn.`) -> our Attention layer's parameter
_ALIASES = {
    "k_scale": "k_scale",
    "v_scale": "v_scale",
    "k_proj.output_scale": "k_scale",
    "v_proj.output_scale": "v_scale",
}
# read and not used: only fp8 attention arithmetic needs them
_UNUSED = ("q_scale", "prob_scale", "q_proj.output_scale")


@dataclass(frozen=True)
class KVCacheScheme:
    """A checkpoint's fp8 KV-cache quantization: one scale per layer or per KV head."""

    strategy: str

    def __str__(self) -> str:
        per = "layer" if self.strategy == "tensor" else "KV head"
        return f"fp8 KV cache, a scale per {per}"


def read_kv_cache_scheme(quant: dict[str, Any]) -> KVCacheScheme | None:
    """The `kv_cache_scheme` of a compressed-tensors `quantization_config`, or None; a
    scheme other than static fp8 per tensor or attention head is an error naming it."""
    args = quant.get("kv_cache_scheme")
    if not args:
        return None
    bits, kind = args.get("num_bits"), args.get("type", "int")
    strategy, dynamic = args.get("strategy") or "tensor", args.get("dynamic", False)
    if bits != 8 or kind != "float" or dynamic or not args.get("symmetric", True):
        raise ValueError(
            f"the checkpoint's kv_cache_scheme ({bits}-bit {kind}, dynamic={dynamic}, "
            f"symmetric={args.get('symmetric', True)}) is not one minivllm loads: it reads "
            "static symmetric fp8 (8-bit float) KV-cache scales"
        )
    if strategy not in STRATEGIES:
        raise ValueError(
            f"the checkpoint's kv_cache_scheme uses strategy {strategy!r}; minivllm reads "
            f"{' and '.join(repr(s) for s in STRATEGIES)} scales"
        )
    return KVCacheScheme(strategy)


def resolve_kv_cache_dtype(
    requested: str, scheme: KVCacheScheme | None, hf_config: Any, kernels_read_fp8: bool = True
) -> str:
    """kv_cache_dtype as the engine runs it: "auto" becomes "fp8" where the checkpoint
    declares an fp8 KV cache (vLLM's resolution), except for a latent (MLA) cache, which
    keeps the model's dtype, and where the engine's attention kernels do not read fp8
    (`kernels_read_fp8` False: the bf16 CPU family), where fp8 would move attention to the
    slower PyTorch path; both logged."""
    if requested != "auto" or scheme is None:
        return requested
    if not kernels_read_fp8:
        logger.warning(
            "the checkpoint declares an fp8 KV cache, but this engine's attention kernels "
            "read bf16 caches only: the cache keeps the model's dtype and the scales go "
            "unused (kv_cache_dtype='fp8' forces fp8, on the slower PyTorch attention)"
        )
        return requested
    if getattr(hf_config, "kv_lora_rank", None):
        logger.warning(
            "the checkpoint declares an fp8 KV cache, but this model's latent (MLA) cache "
            "keeps the model's dtype: its KV-cache scales go unused"
        )
        return requested
    logger.info("kv_cache_dtype 'auto': the checkpoint's kv_cache_scheme asks for fp8 (%s)", scheme)
    return "fp8"


def checkpoint_target(name: str) -> str | None:
    """Our parameter for checkpoint tensor `name` if it is a KV-cache scale (`...self_attn.
    k_scale` -> `...self_attn.attn.k_scale`), "" for one read and left unused, else None."""
    head, sep, leaf = name.partition(".self_attn.")
    if not sep:
        return None
    if leaf in _ALIASES:
        return f"{head}.self_attn.attn.{_ALIASES[leaf]}"
    return "" if leaf in _UNUSED else None
