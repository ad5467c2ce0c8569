"""Qwen3: Llama's shape plus an RMSNorm on each query and key head before the rotation."""

from __future__ import annotations

from typing import Any

import torch

from minivllm.layers.layernorm import RMSNorm
from minivllm.layers.rotary import RotaryEmbedding
from minivllm.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: Any, qkv_bias: bool, rotary_emb: RotaryEmbedding) -> None:
        super().__init__(config, qkv_bias, rotary_emb)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def qk_transform(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple:
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))
        return self.rotary_emb(positions, q, k)

    def qk_norms(self) -> tuple[RMSNorm | None, RMSNorm | None]:
        return self.q_norm, self.k_norm


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
