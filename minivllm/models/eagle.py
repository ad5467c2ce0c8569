"""An EAGLE-1 draft head over a Llama-family or Qwen3 target (Li et al., 2024,
"EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty", arXiv:2401.15077).

At position p the head reads the target's final hidden state f_p (after the final
norm, what the LM head reads) and the embedding of the next token x_{p+1}:

    h = fc([embed(x_{p+1}); f_p])     # 2H -> H
    g = layers.0(h)                   # one decoder layer without its input norm
    g is the predicted f_{p+1}; the target's LM head turns it into draft logits

The checkpoint carries `fc.weight` and `layers.0.*` (the layout of the EAGLE-1 heads
vLLM loads); the embedding and LM head are the target's, handed in by the proposer.
Its attention layer has a KV cache of its own in the target's blocks (position p at
the target's slot for p). `tools/eagle_head.py` is the same head in plain PyTorch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from minivllm.layers.linear import ReplicatedLinear
from minivllm.layers.rotary import RotaryEmbedding
from minivllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, head_dim_of
from minivllm.models.qwen3 import Qwen3Attention
from minivllm.models.weights import load_weights_strict

# copies of the target's tensors some EAGLE checkpoints carry; the target's own are used
_TARGET_TENSORS = ("embed_tokens.weight", "lm_head.weight", "model.embed_tokens.weight")


class EagleForCausalLM(nn.Module):
    def __init__(self, config: Any, max_model_len: int) -> None:
        super().__init__()
        if config.num_hidden_layers != 1:
            raise ValueError(
                f"an EAGLE-1 head has one decoder layer; this checkpoint's config says "
                f"num_hidden_layers={config.num_hidden_layers}"
            )
        self.config = config
        hidden = config.hidden_size
        attention_cls = Qwen3Attention if config.model_type == "qwen3" else LlamaAttention
        rotary = RotaryEmbedding(
            head_dim_of(config),
            config.rope_parameters,
            config.max_position_embeddings,
            max_model_len,
        )
        self.fc = ReplicatedLinear(2 * hidden, hidden, bias=False)
        qkv_bias = getattr(config, "attention_bias", False)
        layer = LlamaDecoderLayer(config, attention_cls(config, qkv_bias, rotary))
        layer.input_layernorm = nn.Identity()  # EAGLE-1: fc's output goes straight in
        self.layers = nn.ModuleList([layer])

    def forward(
        self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Rows of embed(x_{p+1}) and f_p at positions p -> the predicted f_{p+1}."""
        hidden = self.fc(torch.cat([embeds, features.to(embeds.dtype)], dim=-1))
        hidden, residual = self.layers[0](positions, hidden, None)
        return hidden + residual

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_weights_strict(self, weights, LlamaForCausalLM.packed_modules, _TARGET_TENSORS)
