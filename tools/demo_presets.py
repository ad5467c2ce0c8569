"""Architectures and training recipes of the bundled demo models."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DeepseekV32Config, PretrainedConfig, Qwen3Config

VOCAB_SIZE = 4096
EOS_TOKEN_ID = 0  # <|endoftext|>
IM_END_TOKEN_ID = 2  # <|im_end|>
MAX_POSITIONS = 1024
ROPE = {"rope_type": "default", "rope_theta": 10000.0}


@dataclass(frozen=True, slots=True)
class DemoPreset:
    """One demo model: how to build it and how long to train it.

    Training length is a step count, not a time limit, so a run is reproducible
    from its seed; the counts were sized to the CPU budget in docs/demo-models.md.
    """

    name: str
    make_config: Callable[[], PretrainedConfig]
    summary: str
    num_steps: int
    batch_size: int = 16
    seq_len: int = 256
    peak_lr: float = 2e-3
    warmup_steps: int = 50
    weight_decay: float = 0.1
    eval_every: int = 100
    save_dtype: torch.dtype = torch.bfloat16
    attn_implementation: str = "sdpa"
    dense_warmup_fraction: float = (
        0.0  # DSA only: share of steps with the indexer selecting all keys
    )


def base_config() -> Qwen3Config:
    return Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        rope_parameters=dict(ROPE),
        bos_token_id=None,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=EOS_TOKEN_ID,
    )


def draft_config() -> Qwen3Config:
    return Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        rope_parameters=dict(ROPE),
        bos_token_id=None,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=EOS_TOKEN_ID,
    )


def sparse_config() -> DeepseekV32Config:
    """DeepSeek-V3.2: MLA + lightning indexer (top-64 keys) + one dense and one MoE layer."""
    return DeepseekV32Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=192,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        index_topk=64,
        index_n_heads=4,
        index_head_dim=32,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        rope_parameters=dict(ROPE),
        bos_token_id=None,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=EOS_TOKEN_ID,
    )


PRESETS = {
    preset.name: preset
    for preset in (
        DemoPreset(
            name="demo-base",
            make_config=base_config,
            summary="Qwen3 base model for correctness and serving tests",
            num_steps=1000,
        ),
        DemoPreset(
            name="demo-draft",
            make_config=draft_config,
            summary="small Qwen3 draft model for speculative decoding with demo-base",
            num_steps=800,
            peak_lr=3e-3,
            save_dtype=torch.float32,
        ),
        DemoPreset(
            name="demo-sparse",
            make_config=sparse_config,
            summary="DeepSeek-V3.2 (MLA, DSA lightning indexer, MoE) architecture demo",
            num_steps=400,
            save_dtype=torch.float32,
            attn_implementation="eager",
            dense_warmup_fraction=0.5,
        ),
    )
}
