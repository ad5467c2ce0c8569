"""Qwen3: Llama's shape plus an RMSNorm on each query and key head before the rotation."""

from __future__ import annotations

from typing import Any

import torch

from minivllm.layers.layernorm import RMSNorm
from minivllm.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: Any, max_model_len: int, qkv_bias: bool) -> None:
        super().__init__(config, max_model_len, qkv_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def qk_transform(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple:
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))
        return self.rotary_emb(positions, q, k)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
