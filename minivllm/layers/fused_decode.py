"""All decoder layers of a Llama-family model in one C++ call, for steps where every request decodes.

At batch 1 the weights stream in ~40 ms per token and the Python glue between
~60 small calls per layer added another ~5 ms; `decode_layers.cpp` runs the same
bf16 kernels in the same order without it, so its results equal the per-layer
path's bit for bit. The model describes its layers (`DecoderStackParts`, built by
the model file); this module only checks that every part is on the kernel path
(bf16 CPU kernels, one tensor-parallel rank, unquantized linears, one neox rotary
shared by all layers, the cpu attention backend) and says why not where one is not.
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


def why_not_fused(parts: DecoderStackParts, backend: AttentionBackend) -> str | None:
    """None if every part is on the kernel path, else the first reason it is not."""
    rotary = parts.layers[0].rotary
    if type(rotary) is not RotaryEmbedding or not rotary.uses_kernels:
        return "the rotary embedding is not the neox kernel's"
    if not isinstance(backend, CpuAttentionBackend):
        return f"the {backend.name} attention backend has no fused step"
    eps = {parts.final_norm.eps}
    for layer in parts.layers:
        if layer.rotary is not rotary:
            return "layers use different rotary tables"
        if not backend.supports_decode(layer.attn.head_dim):
            return f"head size {layer.attn.head_dim} is not one the decode kernel takes"
        for linear in layer.linears:
            method = linear.quant_method
            if type(method) is not UnquantizedLinearMethod or method.cpu_kernel is None:
                return "a linear layer is quantized or not on the CPU kernel"
            if linear.tp_size != 1:
                return "tensor parallelism splits the layers"
        if any(not norm.uses_kernels for norm in layer.norms):
            return "a norm is not on the kernel path"
        if type(layer.act) is not SiluAndMul or not layer.act.uses_kernels:
            return "the activation is not the kernel's SiLU-and-mul"
        eps |= {norm.eps for norm in layer.norms}
    if len(eps) != 1:
        return "the norms use different epsilons"
    return None


class FusedLlamaDecode:
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
        none = torch.empty(0, dtype=torch.bfloat16)
        self.weights: list[torch.Tensor] = []
        # oneDNN-prepacked copies (or empty) for batches over MAX_KERNEL_ROWS_PACKED rows
        self.packed: list[torch.Tensor] = []
        for layer in parts.layers:
            self.packed += [
                _or(lin.quant_method.cpu_kernel.packed_weight, none) for lin in layer.linears
            ]
            self.weights += [
                layer.input_norm.weight,
                layer.qkv_proj.weight,
                _or(layer.qkv_proj.bias, none),
                none if layer.q_norm is None else layer.q_norm.weight,
                none if layer.k_norm is None else layer.k_norm.weight,
                layer.o_proj.weight,
                _or(layer.o_proj.bias, none),
                layer.post_norm.weight,
                layer.gate_up_proj.weight,
                _or(layer.gate_up_proj.bias, none),
                layer.down_proj.weight,
                _or(layer.down_proj.bias, none),
            ]

    @classmethod
    def build(
        cls, model: nn.Module, kernels: Kernels, backend: AttentionBackend
    ) -> tuple[FusedLlamaDecode | None, str]:
        """The fused path for `model` and "on", or None and the reason it is off."""
        op = kernels.op("llama_decode_layers")
        if op is None:
            return None, f"the {kernels.name} kernels have no fused decode step"
        if not isinstance(model, DescribesDecoderStack):
            return None, f"{type(model).__name__} does not describe its decoder layers"
        parts = model.decoder_stack_parts()
        reason = why_not_fused(parts, backend)
        if reason is not None:
            return None, reason
        return cls(parts, op), "on"

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: PagedAttentionMetadata
    ) -> torch.Tensor:
        """The final-normed hidden states of a step whose every request decodes; one row a token."""
        return self.op(
            self.embed(input_ids),
            self.weights,
            self.packed,
            MAX_KERNEL_ROWS_PACKED,
            [a.kv_cache for a in self.attention],
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


def _or(tensor: torch.Tensor | None, default: torch.Tensor) -> torch.Tensor:
    return default if tensor is None else tensor
