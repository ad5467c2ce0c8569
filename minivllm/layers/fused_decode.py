"""All decoder layers of a Llama-family model in one C++ call, for steps where every request decodes.

At batch 1 the weights stream in ~40 ms per token and the Python glue between
~60 small calls per layer added another ~5 ms; `decode_layers.cpp` runs the same
bf16 kernels in the same order without it, so its results equal the per-layer
path's bit for bit. Used only where every piece it replaces is on the kernel path:
bf16 CPU kernels on, one tensor-parallel rank, unquantized linears, neox rotary
shared by all layers. Anything else keeps the per-layer path.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from minivllm.layers.cpu_linear import MAX_KERNEL_ROWS_PACKED, CpuGemvLinearMethod
from minivllm.layers.forward_context import AttentionMetadata
from minivllm.layers.rotary import RotaryEmbedding


class FusedLlamaDecode:
    def __init__(self, model: nn.Module, kernels: ModuleType) -> None:
        inner = model.model
        layers = list(inner.layers)
        attn0 = layers[0].self_attn
        self.kernels = kernels
        self.embed = inner.embed_tokens
        self.final_norm = inner.norm.weight
        self.rotary: RotaryEmbedding = attn0.rotary_emb
        self.num_heads, self.num_kv_heads = attn0.num_heads, attn0.num_kv_heads
        self.head_dim, self.scale = attn0.head_dim, attn0.attn.scale
        self.eps = inner.norm.eps
        self.attention = [layer.self_attn.attn for layer in layers]
        self.windows = [a.sliding_window or 0 for a in self.attention]
        none = torch.empty(0, dtype=torch.bfloat16)
        self.weights: list[torch.Tensor] = []
        # oneDNN-prepacked copies (or empty) for batches over MAX_KERNEL_ROWS_PACKED rows
        self.packed: list[torch.Tensor] = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.packed += [
                getattr(lin, "packed_weight", none)
                for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            ]
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            self.weights += [
                layer.input_layernorm.weight,
                attn.qkv_proj.weight,
                _or(attn.qkv_proj.bias, none),
                none if q_norm is None else q_norm.weight,
                none if k_norm is None else k_norm.weight,
                attn.o_proj.weight,
                _or(attn.o_proj.bias, none),
                layer.post_attention_layernorm.weight,
                mlp.gate_up_proj.weight,
                _or(mlp.gate_up_proj.bias, none),
                mlp.down_proj.weight,
                _or(mlp.down_proj.bias, none),
            ]

    @classmethod
    def build(cls, model: nn.Module, kernels: ModuleType) -> FusedLlamaDecode | None:
        """The fused path for `model`, or None where some part of it is not on the kernel path."""
        from minivllm.models.llama import (
            LlamaAttention,
            LlamaDecoderLayer,
            LlamaForCausalLM,
            LlamaMLP,
        )
        from minivllm.models.qwen3 import Qwen3Attention

        if not isinstance(model, LlamaForCausalLM):
            return None
        layers = list(model.model.layers)
        rotary = layers[0].self_attn.rotary_emb
        if type(rotary) is not RotaryEmbedding or rotary.kernels is None:
            return None
        eps = {model.model.norm.eps}
        for layer in layers:
            attn = layer.self_attn
            # exactly the classes whose forward decode_layers.cpp reproduces
            if type(layer) is not LlamaDecoderLayer or type(layer.mlp) is not LlamaMLP:
                return None
            if type(attn) not in (LlamaAttention, Qwen3Attention) or attn.rotary_emb is not rotary:
                return None
            if attn.attn.decode_kernel is None:
                return None
            linears = (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            if any(
                type(lin.quant_method) is not CpuGemvLinearMethod or lin.tp_size != 1
                for lin in linears
            ):
                return None
            norms = [layer.input_layernorm, layer.post_attention_layernorm]
            norms += [getattr(attn, n) for n in ("q_norm", "k_norm") if hasattr(attn, n)]
            if any(norm.kernels is None for norm in norms):
                return None
            eps |= {norm.eps for norm in norms}
        if len(eps) != 1 or layers[0].mlp.act_fn.kernels is None:
            return None
        return cls(model, kernels)

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The final-normed hidden states of a step whose every request decodes one token."""
        return self.kernels.llama_decode_layers(
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
