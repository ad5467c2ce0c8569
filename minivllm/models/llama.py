"""Llama, and the architectures that share its shape (Mistral, Qwen2)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from minivllm.layers.activation import SiluAndMul
from minivllm.layers.attention import Attention
from minivllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.fused_decode import DecoderStackParts, LlamaBlockParts
from minivllm.layers.layernorm import RMSNorm
from minivllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from minivllm.layers.rotary import RotaryEmbedding
from minivllm.models.weights import load_weights_strict


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, config.num_attention_heads, num_kv_heads, qkv_bias
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim,
            config.hidden_size,
            getattr(config, "attention_bias", False),
        )
        self.rotary_emb = rotary_emb  # one module, and one cos/sin table, for every layer
        window = getattr(config, "sliding_window", None)
        if getattr(config, "use_sliding_window", True) is False:
            window = None
        self.attn = Attention(self.num_heads, head_dim, self.num_kv_heads, head_dim**-0.5, window)
        self.head_dim = head_dim

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.qk_transform(positions, q, k)
        return self.o_proj(self.attn(q.flatten(1), k.flatten(1), v))

    def qk_transform(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple:
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        return self.rotary_emb(positions, q, k)

    def qk_norms(self) -> tuple[RMSNorm | None, RMSNorm | None]:
        """The per-head norms `qk_transform` applies before the rotation (none here)."""
        return None, None


class LlamaMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias
        )
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention then MLP; `mlp` defaults to Llama's (other models pass an MoE)."""

    def __init__(self, config: Any, attention: nn.Module, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp if mlp is not None else LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def parts(self) -> LlamaBlockParts:
        attn, mlp = self.self_attn, self.mlp
        q_norm, k_norm = attn.qk_norms()
        return LlamaBlockParts(
            self.input_layernorm,
            attn.qkv_proj,
            q_norm,
            k_norm,
            attn.rotary_emb,
            attn.attn,
            attn.o_proj,
            self.post_attention_layernorm,
            mlp.gate_up_proj,
            mlp.act_fn,
            mlp.down_proj,
        )


class LlamaModel(nn.Module):
    def __init__(
        self, config: Any, max_model_len: int, attention_cls: type, qkv_bias: bool
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(
            head_dim_of(config),
            config.rope_parameters,
            config.max_position_embeddings,
            max_model_len,
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, attention_cls(config, qkv_bias, rotary))
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Decoder-only transformer; `compute_logits` is separate so only sampled rows pay for it."""

    attention_cls: type = LlamaAttention
    qkv_bias: bool | None = None  # None: read `attention_bias` from the config
    # checkpoint name -> (our merged parameter, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: Any, max_model_len: int) -> None:
        super().__init__()
        self.config = config
        qkv_bias = self.qkv_bias
        if qkv_bias is None:
            qkv_bias = getattr(config, "attention_bias", False)
        self.model = LlamaModel(config, max_model_len, self.attention_cls, qkv_bias)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def decoder_stack_parts(self) -> DecoderStackParts:
        """The layers as the fused decode step runs them (`layers/fused_decode.py`)."""
        inner = self.model
        return DecoderStackParts(
            inner.embed_tokens, [layer.parts() for layer in inner.layers], inner.norm
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skip = ("lm_head.weight",) if self.config.tie_word_embeddings else ()
        load_weights_strict(self, weights, self.packed_modules, skip)


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
