"""All decoder layers of a Llama-family model in one C++ call, for steps where every request decodes.

At batch 1 the weights stream in ~40 ms per token and the Python glue between
~60 small calls per layer added another ~5 ms; `decode_layers.cpp` runs the same
bf16 kernels in the same order without it, so its results equal the per-layer
path's bit for bit. The model describes its layers (`DecoderStackParts`, built by
the model file); this module only checks that every part is on the kernel path
(bf16 CPU kernels, one tensor-parallel rank, linears that are bf16 on the CPU kernel or
quantized in a format the kernels take, one neox rotary shared by all layers, the cpu
attention backend) and says why not where one is not.

A quantized linear qualifies when its method exposes `quant_weights`, a
`quantization.formats.QuantWeights` the kernels support on this CPU and shape, and keeps
`kernels_on` true (it runs our bf16 kernels itself); the step then gets, per linear, its
kind, its rows (empty where VNNI panels replaced them) and [scale, zero, wsum, packed
copy: int8_w8a8's AMX or VNNI one, int4_w4a8's panels] (empty tensors for none).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from minivllm.kernels.registry import Kernels
from minivllm.layers.activation import SiluAndMul
from minivllm.layers.attention.backend import AttentionBackend
from minivllm.layers.attention.cpu_backend import CpuAttentionBackend
from minivllm.layers.attention.layer import Attention
from minivllm.layers.attention.torch_backend import PagedAttentionMetadata
from minivllm.layers.cpu_linear import MAX_KERNEL_ROWS_PACKED
from minivllm.layers.embedding import VocabParallelEmbedding
from minivllm.layers.layernorm import RMSNorm
from minivllm.layers.linear import LinearBase
from minivllm.layers.linear_method import UnquantizedLinearMethod
from minivllm.layers.rotary import RotaryEmbedding
from minivllm.quantization.formats import KERNEL_KIND, KIND_INT8_W8A8, QuantWeights
from minivllm.quantization.kernel_limits import (
    AMX_MAX_STREAMING_ROWS,
    MAX_DEQUANTIZED_ROWS,
    MAX_STREAMING_ROWS,
    MAX_STREAMING_ROWS_FP8_BLOCKS,
    kernel_supports,
    kernel_supports_shape,
    packed_layout,
    w8a8_max_kernel_rows,
)


@dataclass(slots=True)
class LlamaBlockParts:
    """One pre-norm decoder layer as decode_layers.cpp runs it:
    x -> input_norm -> qkv_proj -> [q_norm, k_norm per head] -> rotary -> attn -> o_proj
      -> add & post_norm -> gate_up_proj -> act (SiLU-and-mul) -> down_proj."""

    input_norm: RMSNorm
    qkv_proj: LinearBase
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    rotary: nn.Module
    attn: Attention
    o_proj: LinearBase
    post_norm: RMSNorm
    gate_up_proj: LinearBase
    act: nn.Module
    down_proj: LinearBase

    @property
    def linears(self) -> tuple[LinearBase, ...]:
        return (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj)

    @property
    def norms(self) -> list[RMSNorm]:
        extra = [n for n in (self.q_norm, self.k_norm) if n is not None]
        return [self.input_norm, self.post_norm, *extra]


@dataclass(slots=True)
class DecoderStackParts:
    embed: VocabParallelEmbedding
    layers: list[LlamaBlockParts]
    final_norm: RMSNorm


@runtime_checkable
class DescribesDecoderStack(Protocol):
    """A model whose decoder layers the fused decode step can run."""

    def decoder_stack_parts(self) -> DecoderStackParts: ...


def why_not_fused(
    parts: DecoderStackParts,
    backend: AttentionBackend,
    fp32: bool = False,
    kv_dtype: torch.dtype | None = None,
) -> str | None:
    """None if every part is on the kernel path, else the first reason it is not.
    `fp32`: for the AVX2 family's step (Avx2FusedDecode), whose linears are bf16 panels or
    linear_quantw's schemes. `kv_dtype`: what the KV cache stores (None: the engine's dtype)."""
    rotary = parts.layers[0].rotary
    if type(rotary) is not RotaryEmbedding or not rotary.uses_kernels:
        return "the rotary embedding is not the neox kernel's"
    if not isinstance(backend, CpuAttentionBackend):
        return f"the {backend.name} attention backend has no fused step"
    if kv_dtype is not None and not backend.supports_cache_dtype(kv_dtype):
        return f"the decode kernels do not read a {str(kv_dtype).removeprefix('torch.')} KV cache"
    if not fp32 and any(layer.attn.kv_scales is not None for layer in parts.layers):
        return "the bf16 decode step does not apply KV-cache scales"
    eps = {parts.final_norm.eps}
    for layer in parts.layers:
        if layer.rotary is not rotary:
            return "layers use different rotary tables"
        if not backend.supports_decode(layer.attn.head_dim):
            return f"head size {layer.attn.head_dim} is not one the decode kernel takes"
        for linear in layer.linears:
            reason = _why_not_fp32_linear(linear) if fp32 else _why_not_kernel_linear(linear)
            if reason is not None:
                return reason
        if any(not norm.uses_kernels for norm in layer.norms):
            return "a norm is not on the kernel path"
        if type(layer.act) is not SiluAndMul or not layer.act.uses_kernels:
            return "the activation is not the kernel's SiLU-and-mul"
        eps |= {norm.eps for norm in layer.norms}
    if len(eps) != 1:
        return "the norms use different epsilons"
    return None


def _why_not_kernel_linear(linear: LinearBase) -> str | None:
    if linear.tp_size != 1:
        return "tensor parallelism splits the layers"
    method = linear.quant_method
    if type(method) is UnquantizedLinearMethod:
        return None if method.cpu_kernel is not None else "a linear layer is not on the CPU kernel"
    weights = _quant_weights(linear)
    if weights is None:
        return f"a linear layer's {type(method).__name__} does not run on the CPU kernels"
    scheme, k = weights.scheme, weights.in_features
    if not kernel_supports(scheme) or not kernel_supports_shape(scheme, k, weights.group_size):
        return f"the {scheme} kernel does not run on this CPU or takes no K={k}"
    return None


# decode_layers.cpp's index of block-scaled fp8's row limit, after one per quant kind, then
# those of int4's and block-scaled fp8's dequantized_linear (kernel_limits.MAX_DEQUANTIZED_ROWS),
# then the weight-only kinds' on AMX tiles (QuantizedLinearMethod.amx_rows), then kinds 1-3's
# streaming rows before them on a layer the AMX kernel takes (kernel_limits.AMX_MAX_STREAMING_ROWS)
FP8_BLOCKS_ROWS = max(KERNEL_KIND.values()) + 1
INT4_DEQUANTIZED_ROWS, FP8_BLOCKS_DEQUANTIZED_ROWS = FP8_BLOCKS_ROWS + 1, FP8_BLOCKS_ROWS + 2
AMX_WEIGHT_ONLY_ROWS = FP8_BLOCKS_ROWS + 3
AMX_STREAMING_ROWS = AMX_WEIGHT_ONLY_ROWS + 1  # + kind - 1, kinds 1-3

# linear_quantw's kinds (kernels/avx2_quant.cpp); int8_w8a8 in an fp32 engine quantizes
# its activations in Python first (QuantizedLinearMethod._apply_fp32), so it has no step
_FP32_KINDS = {"int8_w8a16": 1, "int4_w4a16": 2, "fp8_w8a16": 3, "int4_w4a8": 5}


def _why_not_fp32_linear(linear: LinearBase) -> str | None:
    if linear.tp_size != 1:
        return "tensor parallelism splits the layers"
    method = linear.quant_method
    if type(method) is UnquantizedLinearMethod:
        if method.panel_kernel is None and linear.weight.dtype != torch.float32:
            return f"a linear layer's weight is {linear.weight.dtype}"
        return None  # bf16 panels, or an fp32 weight (not bf16 values) on at::linear
    weights = getattr(method, "quant_weights", None)
    if not isinstance(weights, QuantWeights) or getattr(method, "fp32_op", None) is None:
        return f"a linear layer's {type(method).__name__} does not run on the AVX2 kernels"
    if weights.scheme not in _FP32_KINDS:
        return f"{weights.scheme} has no fused fp32 step"
    return None


def _quant_weights(linear: LinearBase) -> QuantWeights | None:
    """The kernel-format weights of a quantized linear whose method runs the kernels."""
    method = linear.quant_method
    weights = getattr(method, "quant_weights", None)
    if isinstance(weights, QuantWeights) and getattr(method, "kernels_on", False):
        return weights
    return None


class _DecodeStep:
    """What both families' one-call steps take: the layers' norms and weights (12 per layer,
    decode_layers.cpp's Slot order), caches and rotary; each family adds its linears'
    description (`_linear_args`, passed after the weights)."""

    def __init__(self, parts: DecoderStackParts, op: Callable[..., torch.Tensor]) -> None:
        attn0 = parts.layers[0].attn
        self.op = op
        self.embed = parts.embed
        self.final_norm = parts.final_norm.weight
        self.rotary: RotaryEmbedding = parts.layers[0].rotary
        self.num_heads, self.num_kv_heads = attn0.num_heads, attn0.num_kv_heads
        self.head_dim, self.scale = attn0.head_dim, attn0.scale
        self.eps = parts.final_norm.eps
        self.attention = [layer.attn for layer in parts.layers]
        self.windows = [a.sliding_window or 0 for a in self.attention]
        self.weights: list[torch.Tensor] = []

    @staticmethod
    def _layer_weights(
        layer: LlamaBlockParts, weight: Callable[[LinearBase], torch.Tensor], none: torch.Tensor
    ) -> list[torch.Tensor]:
        return [
            layer.input_norm.weight,
            weight(layer.qkv_proj),
            _or(layer.qkv_proj.bias, none),
            none if layer.q_norm is None else layer.q_norm.weight,
            none if layer.k_norm is None else layer.k_norm.weight,
            weight(layer.o_proj),
            _or(layer.o_proj.bias, none),
            layer.post_norm.weight,
            weight(layer.gate_up_proj),
            _or(layer.gate_up_proj.bias, none),
            weight(layer.down_proj),
            _or(layer.down_proj.bias, none),
        ]

    def _linear_args(self) -> tuple:
        raise NotImplementedError

    def _scale_args(self) -> tuple:
        """The KV-cache scales, for a step that takes them (after the caches)."""
        return ()

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: PagedAttentionMetadata
    ) -> torch.Tensor:
        """The final-normed hidden states of a step whose every request decodes; one row a token."""
        return self.op(
            self.embed(input_ids),
            self.weights,
            *self._linear_args(),
            [a.kv_cache for a in self.attention],
            *self._scale_args(),
            self.windows,
            self.final_norm,
            positions,
            meta.slot_mapping,
            meta.decode_block_tables,
            meta.decode_seq_lens,
            self.rotary.cos_cache,
            self.rotary.sin_cache,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.eps,
            self.scale,
        )


class FusedLlamaDecode(_DecodeStep):
    """The bf16 family's step (`kernels/decode_layers.cpp`)."""

    def __init__(self, parts: DecoderStackParts, op: Callable[..., torch.Tensor]) -> None:
        super().__init__(parts, op)
        none = torch.empty(0, dtype=torch.bfloat16)
        # per linear: bf16's oneDNN-prepacked copy (or empty) and the rows up to which its
        # GEMV runs (the bf16 linears' CpuLinearKernel.max_rows, one value for the model:
        # all are prepacked or none); the quantization kind (0: bf16) and its tensors
        self.max_kernel_rows = MAX_KERNEL_ROWS_PACKED
        self.packed: list[torch.Tensor] = []
        self.quant_kinds: list[int] = []
        self.quant: list[torch.Tensor] = []
        # per quant kind (index): rows up to which quant_linear runs it (kernel_limits.max_kernel_rows);
        # int8_w8a8's is set by its packed copies, all alike on a machine (none: every row)
        # (then, at FP8_BLOCKS_ROWS, block-scaled fp8's, which streams fewer rows than
        # per-channel fp8: the step reads it for a kind-3 layer whose scale is 2-D; then
        # the rows up to which int4 and block-scaled fp8 run dequantized_linear)
        self.max_quant_rows = [0] * (AMX_STREAMING_ROWS + 3)
        for scheme, rows in MAX_STREAMING_ROWS.items():
            self.max_quant_rows[KERNEL_KIND[scheme]] = rows
        self.max_quant_rows[KIND_INT8_W8A8] = w8a8_max_kernel_rows(None)
        self.max_quant_rows[FP8_BLOCKS_ROWS] = MAX_STREAMING_ROWS_FP8_BLOCKS
        self.max_quant_rows[INT4_DEQUANTIZED_ROWS] = MAX_DEQUANTIZED_ROWS["int4_w4a16"]
        self.max_quant_rows[FP8_BLOCKS_DEQUANTIZED_ROWS] = MAX_DEQUANTIZED_ROWS["fp8_blocks"]
        self._w8a8_layout: str | None = None  # the int8_w8a8 copies' (kernel_limits.packed_layout)
        for layer in parts.layers:
            for linear in layer.linears:
                self._add_linear(linear, none)
            self.weights += self._layer_weights(layer, _weight, none)

    def _linear_args(self) -> tuple:
        return (
            self.packed,
            self.max_kernel_rows,
            self.quant_kinds,
            self.quant,
            self.max_quant_rows,
        )

    def _add_linear(self, linear: LinearBase, none: torch.Tensor) -> None:
        weights = _quant_weights(linear)
        if weights is None:
            kernel = linear.quant_method.cpu_kernel
            self.packed.append(_or(kernel.packed_weight, none))
            self.max_kernel_rows = kernel.max_rows
            self.quant_kinds.append(0)
            self.quant += [none] * 4
            return
        self.packed.append(none)
        self.quant_kinds.append(weights.kind)
        self.quant += [_or(t, none) for t in (weights.scale, weights.zero, weights.wsum)]
        self.quant.append(_or(weights.packed, none))
        if getattr(linear.quant_method, "amx_op", None) is not None:
            # the step asks amx_weight_only_supports of each layer itself, as the method
            # did (kernel_limits.amx_weight_only_takes), and streams fewer rows on those
            self.max_quant_rows[AMX_WEIGHT_ONLY_ROWS] = linear.quant_method.amx_rows
            for scheme, rows in AMX_MAX_STREAMING_ROWS.items():
                self.max_quant_rows[AMX_STREAMING_ROWS + KERNEL_KIND[scheme] - 1] = rows
        if weights.packed is not None and weights.kind == KIND_INT8_W8A8:
            # int8_w8a8's copy: the AMX kernel's or the VNNI GEMM's
            # one threshold serves every layer: use() packs them all alike on a machine
            layout = packed_layout(weights.packed)
            assert self._w8a8_layout in (None, layout), "int8_w8a8 layers packed two ways"
            self._w8a8_layout = layout
            self.max_quant_rows[KIND_INT8_W8A8] = w8a8_max_kernel_rows(weights.packed)

    @classmethod
    def build(
        cls,
        model: nn.Module,
        kernels: Kernels,
        backend: AttentionBackend,
        kv_dtype: torch.dtype | None = None,
    ) -> tuple[FusedLlamaDecode | Avx2FusedDecode | None, str]:
        """The fused path for `model` and "on", or None and the reason it is off: the bf16
        family's step, or the AVX2 family's (fp32 engines). `kv_dtype`: the KV cache's."""
        op = kernels.op("llama_decode_layers")
        fp32_op = kernels.op("avx2_decode_layers")
        if op is None and fp32_op is None:
            return None, f"the {kernels.name} kernels have no fused decode step"
        if not isinstance(model, DescribesDecoderStack):
            return None, f"{type(model).__name__} does not describe its decoder layers"
        parts = model.decoder_stack_parts()
        reason = why_not_fused(parts, backend, fp32=op is None, kv_dtype=kv_dtype)
        if reason is not None:
            return None, reason
        return (cls(parts, op) if op is not None else Avx2FusedDecode(parts, fp32_op)), "on"


class Avx2FusedDecode(_DecodeStep):
    """The fp32 engine's decode step on the AVX2 family (`kernels/avx2_decode.cpp`): the
    same layers, each linear bf16 panels, an fp32 weight, or a linear_quantw scheme."""

    def __init__(self, parts: DecoderStackParts, op: Callable[..., torch.Tensor]) -> None:
        super().__init__(parts, op)
        none = torch.empty(0)
        # per linear: kind (0: bf16 panels, -1: an fp32 weight, else linear_quantw's),
        # output size, group size; and its scale and zero
        self.linears: list[int] = []
        self.quant: list[torch.Tensor] = []
        for layer in parts.layers:
            for linear in layer.linears:
                weights = getattr(linear.quant_method, "quant_weights", None)
                if isinstance(weights, QuantWeights):
                    kind = _FP32_KINDS[weights.scheme]
                    self.linears += [kind, weights.out_features, weights.group_size]
                    self.quant += [weights.scale, _or(weights.zero, none)]
                elif linear.quant_method.panel_kernel is not None:
                    self.linears += [0, linear.quant_method.panel_kernel.n, 0]
                    self.quant += [none, none]
                else:
                    self.linears += [-1, linear.weight.shape[0], 0]
                    self.quant += [none, none]
            self.weights += self._layer_weights(layer, _fp32_weight, none)

    def _linear_args(self) -> tuple:
        return (self.linears, self.quant)

    def _scale_args(self) -> tuple:
        # per layer: an fp8 cache's scales [4, Hkv] (quantization/kv_cache.py), or empty
        none = torch.empty(0)
        return ([_or(a.kv_scales, none) for a in self.attention],)


def _weight(linear: LinearBase) -> torch.Tensor:
    weights = _quant_weights(linear)
    return linear.weight if weights is None else weights.weight


def _fp32_weight(linear: LinearBase) -> torch.Tensor:
    weights = getattr(linear.quant_method, "quant_weights", None)
    return weights.weight if isinstance(weights, QuantWeights) else linear.weight


def _or(tensor: torch.Tensor | None, default: torch.Tensor) -> torch.Tensor:
    return default if tensor is None else tensor
