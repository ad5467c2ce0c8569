"""Which compiled op serves a layer: a small registry keyed by (op, device, dtype, ISA).

Layers never import the kernels module. Once the model is loaded, each layer asks
the engine's `Kernels` for the ops it can use (`kernels.op("rms_norm")`) and keeps
what it gets; None means "use your plain-PyTorch path". A new kernel family (an
AVX2 build, a CUDA extension) registers its ops under its own `KernelKey` below
and `select_kernels` picks it where the machine has its ISA.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from minivllm.kernels.isa import cpu_flags

logger = logging.getLogger("minivllm")


@dataclass(frozen=True, slots=True)
class KernelKey:
    """What a compiled op needs: the device it runs on, the dtype it reads, the ISA it was built for."""

    device: str
    dtype: torch.dtype
    isa: str


# op name -> {key: attribute of the compiled module}
_OPS: dict[str, dict[KernelKey, str]] = {}
# key -> (the flags its ISA needs, a loader returning the compiled module or None)
_FAMILIES: dict[KernelKey, tuple[tuple[str, ...], Callable[[], ModuleType | None]]] = {}


def register_family(
    key: KernelKey,
    required_flags: tuple[str, ...],
    load: Callable[[], ModuleType | None],
    ops: dict[str, str],
) -> None:
    """Register a compiled kernel family: the CPU flags it needs, its loader, and its ops."""
    _FAMILIES[key] = (required_flags, load)
    for op, symbol in ops.items():
        _OPS.setdefault(op, {})[key] = symbol


def _load_avx512_bf16() -> ModuleType | None:
    from minivllm.kernels import get_cpu_kernels

    return get_cpu_kernels()


AVX512_BF16 = KernelKey("cpu", torch.bfloat16, "avx512_bf16")
register_family(
    AVX512_BF16,
    ("avx512f", "avx512bw", "avx512_bf16"),
    _load_avx512_bf16,
    {
        op: op
        for op in (
            "gemv_bf16",
            "rms_norm",
            "fused_add_rms_norm",
            "rotary_inplace",
            "silu_and_mul",
            "write_kv_cache",
            "paged_attention_decode",
            "prefill_attention",
            "argmax_bf16",
            "llama_decode_layers",
            "watermark_argmax",
            "quant_linear",
            "quantize_per_token_int8",
            "quantize_weight",
            "pack_vnni_w8a8",
            "pack_amx_w8a8",
            "pack_vnni_w4a8",
            "dequantize_bf16",
            "dequantized_linear",
            "amx_w8a8_available",
            "amx_bf16_available",
            "amx_w8a8_linear",
            "amx_weight_only_linear",
            "vnni_w8a8_linear",
            "w8a8_packed_linear",
            "int4_w4a8_packed_linear",
            "dsa_indexer_topk",
            "sparse_mla_decode",
            "moe_experts",
            "moe_quant_experts",
            "moe_grouped_topk",
        )
    },
)


def _load_avx2() -> ModuleType | None:
    from minivllm.kernels import get_avx2_kernels

    return get_avx2_kernels()


# fp32 engines on any CPU with AVX2 + FMA (+ F16C, which every AVX2 CPU has): the default dtype where there is no AVX512-BF16
# (config.resolve_dtype). Registered after the bf16 family: a dtype picks one or the other.
AVX2 = KernelKey("cpu", torch.float32, "avx2")
register_family(
    AVX2,
    ("avx2", "fma", "f16c"),  # F16C: fp8 decodes through fp16 (avx2_math.h)
    _load_avx2,
    {
        **{
            op: op
            for op in (
                "linear_bf16w",
                "linear_quantw",
                "moe_quantw",
                "moe_bf16w",
                "moe_grouped_topk",
                "paged_attention_decode",
                "rms_norm",
                "fused_add_rms_norm",
                "silu_and_mul",
                "rotary_inplace",
                "write_kv_cache",
                # int8_w8a8 on AVX-512 CPUs with VNNI (avx2_vnni.cpp; refused without it)
                "vnni_w8a8_linear",
                "pack_vnni_w8a8",
            )
        },
        # its own signature (layers/fused_decode.py's Avx2FusedDecode), not the bf16 step's
        "avx2_decode_layers": "decode_layers",
    },
)


@dataclass(frozen=True)
class Kernels:
    """The compiled ops this engine uses, chosen once at start-up from config and machine.

    `key` None means plain PyTorch everywhere (another device or dtype, kernels
    switched off, or a CPU without the instructions). `prepack_weights` lets the
    linear layers keep oneDNN-prepacked copies of their weights (`layers/cpu_linear.py`).
    """

    key: KernelKey | None = None
    module: ModuleType | None = None
    prepack_weights: bool = False

    @property
    def name(self) -> str:
        return "torch" if self.key is None else f"{self.key.device}-{self.key.isa}"

    def op(self, name: str) -> Callable | None:
        if self.key is None or self.module is None:
            return None
        symbol = _OPS.get(name, {}).get(self.key)
        return None if symbol is None else getattr(self.module, symbol)


TORCH = Kernels()


def select_kernels(device: str, dtype: torch.dtype, enabled: bool = True) -> Kernels:
    """The first registered family whose device, dtype and ISA match, compiled; else TORCH."""
    if not enabled:
        logger.info("compiled kernels switched off: plain PyTorch ops")
        return TORCH
    flags = cpu_flags() if device == "cpu" else frozenset()
    for key, (required, load) in _FAMILIES.items():
        if key.device != device or key.dtype != dtype or not set(required) <= flags:
            continue
        module = load()
        if module is not None:
            return Kernels(key, module)
    if device == "cpu":
        # a warning where a user expects the fast path (bf16, float32)
        log = logger.warning if dtype in (torch.bfloat16, torch.float32) else logger.info
        log(
            "no compiled kernels for %s on this CPU (needs %s): plain PyTorch ops, the "
            "fast path is off",
            dtype,
            " or ".join(f"{k.dtype} with {k.isa}" for k in _FAMILIES if k.device == device),
        )
    return TORCH
