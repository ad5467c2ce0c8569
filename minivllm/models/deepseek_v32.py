"""DeepSeek-V3.2: multi-head latent attention made sparse by a lightning indexer (DSA),
with DeepSeek's mixture of experts. Wiring only: the cache and the attention math are
`layers/attention/mla.py` and its backend, the experts `layers/moe.py`.

Tensor parallelism splits the attention heads (q_b_proj, kv_b_proj, o_proj), the dense
MLPs and every expert's intermediate dimension; the latent projections, the latent cache
and the indexer are replicated, so each rank selects the same tokens.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from minivllm.distributed.parallel_state import get_tp_size
from minivllm.layers.activation import SiluAndMul
from minivllm.layers.attention.mla import MLAAttention
from minivllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.layernorm import RMSNorm
from minivllm.layers.linear import (
    ColumnParallelLinear,
    Float32Linear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    divide,
)
from minivllm.layers.moe import FusedMoE, GroupedTopKRouter
from minivllm.layers.rotary import RotaryEmbedding
from minivllm.models.llama import LlamaDecoderLayer, LlamaModel
from minivllm.models.weights import load_weights_strict

_EXPERT_WEIGHT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)$")
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def yarn_softmax_scale(config: Any) -> float:
    """(qk_nope + qk_rope)^-0.5, times mscale^2 under YaRN when `mscale_all_dim` is set
    (the attention logits' share of YaRN's temperature; the cos/sin tables carry the rest)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = config.rope_parameters or {}
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        factor = params["factor"]
        if factor > 1:
            mscale = 0.1 * params["mscale_all_dim"] * math.log(factor) + 1.0
            scale *= mscale * mscale
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek's MLA rotates interleaved pairs (x0, x1), (x2, x3)...; laid out as
    [x0, x2, ... | x1, x3, ...] the same rotation is the usual half-split one. Queries
    and keys both go through this, so their dot products are unchanged."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class DeepseekV32Indexer(nn.Module):
    """The lightning indexer's projections: per-token index queries, one key, head weights."""

    def __init__(self, config: Any, rotary: RotaryEmbedding, interleaved: bool = False) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.interleaved = interleaved  # GLM-MoE-DSA's indexer rotates interleaved pairs
        self.wq_b = ReplicatedLinear(config.q_lora_rank, self.n_heads * self.head_dim, False)
        self.wk = ReplicatedLinear(config.hidden_size, self.head_dim, False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = Float32Linear(config.hidden_size, self.n_heads)
        self.rotary_emb = rotary

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, q_resid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # DeepSeek-V3.2's indexer rotates half-split (NOT interleaved) pairs of its first
        # qk_rope dims; GLM-MoE-DSA's interleaved ones, which deinterleave() turns into
        # the half-split layout (queries and keys alike, so the scores are unchanged)
        q = self.wq_b(q_resid).view(-1, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(hidden)).unsqueeze(1)
        if self.interleaved:
            r = self.rope_dim
            q = torch.cat((deinterleave(q[..., :r]), q[..., r:]), dim=-1)
            k = torch.cat((deinterleave(k[..., :r]), k[..., r:]), dim=-1)
        q = self.rotary_emb.rotate(positions, q)
        k = self.rotary_emb.rotate(positions, k)
        weights = self.weights_proj(hidden) * self.n_heads**-0.5
        return q, k.squeeze(1), weights


def indexer_types(config: Any) -> list[str]:
    """Per layer "full" (it runs its indexer) or "shared" (GLM-MoE-DSA: it reuses the
    selection of the last full layer before it); DeepSeek-V3.2's layers are all full."""
    types = list(getattr(config, "indexer_types", None) or ["full"] * config.num_hidden_layers)
    if len(types) != config.num_hidden_layers or set(types) - {"full", "shared"}:
        raise ValueError(f"indexer_types must give 'full' or 'shared' per layer, got {types}")
    if types and types[0] != "full":
        raise ValueError("the first layer must run its own indexer (indexer_types[0] 'full')")
    return types


class DeepseekV32Attention(nn.Module):
    def __init__(
        self,
        config: Any,
        rotary: RotaryEmbedding,
        shared_index: bool = False,
        interleaved_index: bool = False,
    ) -> None:
        """`shared_index`: no indexer of its own, the previous full layer's selection;
        `interleaved_index`: the indexer's RoPE pairs are interleaved (GLM-MoE-DSA)."""
        super().__init__()
        if not getattr(config, "q_lora_rank", None):
            raise ValueError("DeepSeek sparse attention needs q_lora_rank (its indexer reads q_a)")
        self.num_heads = divide(config.num_attention_heads, get_tp_size())
        self.qk_nope, self.qk_rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        qk_head_dim = self.qk_nope + self.qk_rope
        bias = getattr(config, "attention_bias", False)
        self.q_a_proj = ReplicatedLinear(config.hidden_size, config.q_lora_rank, bias)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank)
        self.q_b_proj = ColumnParallelLinear(
            config.q_lora_rank, config.num_attention_heads * qk_head_dim, False
        )
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            config.hidden_size, self.kv_lora_rank + self.qk_rope, bias
        )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank,
            config.num_attention_heads * (self.qk_nope + config.v_head_dim),
            False,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * config.v_head_dim, config.hidden_size, bias
        )
        self.rotary_emb = rotary
        self.indexer = (
            None if shared_index else DeepseekV32Indexer(config, rotary, interleaved_index)
        )
        self.attn = MLAAttention(
            self.num_heads,
            self.qk_nope,
            self.qk_rope,
            config.v_head_dim,
            self.kv_lora_rank,
            yarn_softmax_scale(config),
            self.kv_b_proj,
            config.index_topk,
            0 if shared_index else config.index_head_dim,
            shared_index,
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q_resid = self.q_a_layernorm(self.q_a_proj(hidden))
        q = self.q_b_proj(q_resid).view(-1, self.num_heads, self.qk_nope + self.qk_rope)
        c_kv, k_pe = self.kv_a_proj_with_mqa(hidden).split(
            [self.kv_lora_rank, self.qk_rope], dim=-1
        )
        c_kv = self.kv_a_layernorm(c_kv.contiguous())
        q_pe = self.rotary_emb.rotate(positions, deinterleave(q[..., self.qk_nope :]))
        k_pe = self.rotary_emb.rotate(positions, deinterleave(k_pe).unsqueeze(1)).squeeze(1)
        q = torch.cat((q[..., : self.qk_nope], q_pe), dim=-1)
        if self.indexer is None:
            return self.o_proj(self.attn(q, c_kv, k_pe))
        index_q, index_k, index_w = self.indexer(positions, hidden, q_resid)
        return self.o_proj(self.attn(q, c_kv, k_pe, index_q, index_k, index_w))


class DeepseekMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DeepseekMoE(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.gate = GroupedTopKRouter(
            config.hidden_size,
            config.n_routed_experts,
            config.num_experts_per_tok,
            config.n_group or 1,
            config.topk_group or 1,
            config.norm_topk_prob,
            config.routed_scaling_factor,
        )
        self.experts = FusedMoE(
            config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        )
        self.shared_experts = None
        if config.n_shared_experts:
            self.shared_experts = DeepseekMLP(
                config.hidden_size, config.moe_intermediate_size * config.n_shared_experts
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)


def mlp_layer_types(config: Any) -> list[str]:
    types = getattr(config, "mlp_layer_types", None)
    if types is None:
        dense = min(config.first_k_dense_replace, config.num_hidden_layers)
        types = ["dense"] * dense + ["sparse"] * (config.num_hidden_layers - dense)
    return list(types)


def make_decoder_layer(
    config: Any,
    rotary: RotaryEmbedding,
    mlp_type: str,
    index_type: str = "full",
    interleaved_index: bool = False,
) -> LlamaDecoderLayer:
    if mlp_type == "sparse":
        mlp: nn.Module = DeepseekMoE(config)
    else:
        mlp = DeepseekMLP(config.hidden_size, config.intermediate_size)
    attn = DeepseekV32Attention(config, rotary, index_type == "shared", interleaved_index)
    return LlamaDecoderLayer(config, attn, mlp)


class DeepseekV32Model(LlamaModel):
    """Llama's stack and forward (embed, pre-norm layers, final norm) over DeepSeek layers."""

    interleaved_index = False

    def __init__(self, config: Any, max_model_len: int) -> None:
        nn.Module.__init__(self)  # LlamaModel's own __init__ builds Llama layers
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(
            config.qk_rope_head_dim,
            config.rope_parameters,
            config.max_position_embeddings,
            max_model_len,
        )
        self.layers = nn.ModuleList(
            make_decoder_layer(config, rotary, kind, index, self.interleaved_index)
            for kind, index in zip(mlp_layer_types(config), indexer_types(config), strict=True)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV32ForCausalLM(nn.Module):
    packed_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    model_class: type[DeepseekV32Model] = DeepseekV32Model

    def __init__(self, config: Any, max_model_len: int) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_class(config, max_model_len)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Routed experts arrive one matrix at a time (`...experts.7.up_proj.weight`) and are
        stacked here; the rest is loaded strictly. The checkpoint's multi-token-prediction
        layers (indices past num_hidden_layers, as DeepSeek-V3.2 ships) are skipped."""
        modules = dict(self.named_modules())
        stacked = {n for n, p in self.named_parameters() if n.endswith((".w13", ".w2"))}
        expected = {
            (name, e, proj)
            for name, module in modules.items()
            if isinstance(module, FusedMoE)
            for e in range(module.num_experts)
            for proj in ("gate_proj", "up_proj", "down_proj")
        }
        loaded: set[tuple[str, int, str]] = set()

        def others() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                layer = _LAYER_INDEX.match(name)
                if layer and int(layer.group(1)) >= self.config.num_hidden_layers:
                    continue
                match = _EXPERT_WEIGHT.match(name)
                if match is None:
                    yield name, tensor
                    continue
                owner, expert, proj, suffix = match.groups()
                expert = int(expert)
                if (owner, expert, proj) not in expected:
                    raise ValueError(f"unexpected weight {name!r}: the model has no such expert")
                module = modules[owner]
                if module.quant_method is not None and hasattr(
                    module.quant_method, "load_expert_tensor"
                ):  # the checkpoint stores them quantized (quantization/checkpoint_moe.py)
                    module.quant_method.load_expert_tensor(
                        module, name, expert, proj, suffix, tensor
                    )
                    loaded.add((owner, expert, proj))
                    continue
                if suffix != "weight":
                    raise ValueError(
                        f"unexpected weight {name!r}: the checkpoint's config declares no "
                        "quantization for the routed experts"
                    )
                if tensor.element_size() < 2 or not tensor.is_floating_point():
                    raise ValueError(
                        f"{name} is stored as {tensor.dtype}, but the checkpoint's config "
                        "declares no quantization for its routed experts (quantized routed "
                        "experts load from a quantization_config: transformers' fp8 or "
                        "compressed-tensors)"
                    )
                module.load_expert_weight(expert, proj, tensor.to(module.dtype))
                loaded.add((owner, expert, proj))

        skip = tuple(stacked) + (("lm_head.weight",) if self.config.tie_word_embeddings else ())
        load_weights_strict(self, others(), self.packed_modules, skip)
        missing = sorted(expected - loaded)
        if missing:
            owner, expert, proj = missing[0]
            raise ValueError(
                f"the checkpoint is missing weights: {owner}.{expert}.{proj}.weight"
                + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else "")
            )


class GlmMoeDsaModel(DeepseekV32Model):
    interleaved_index = True


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    """GLM-MoE-DSA (GLM-5): DeepSeek-V3.2's layers, with an indexer that rotates
    interleaved RoPE pairs, and layers marked "shared" in `indexer_types` that run no
    indexer and attend over the selection of the last full layer before them (in the
    same step: the backend keeps it), so they keep no indexer keys in their cache."""

    model_class = GlmMoeDsaModel
