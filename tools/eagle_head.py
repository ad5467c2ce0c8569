"""An EAGLE-1 draft head in plain PyTorch: the training-side definition and a second
code path for the engine's `minivllm/models/eagle.py` (tests compare the two).

EAGLE (Li et al., 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty", arXiv:2401.15077) drafts at the feature level. At position p it reads
the target's final hidden state f_p (after the final norm: what the LM head reads)
and the embedding of the token that followed, x_{p+1}:

    h = fc([embed(x_{p+1}); f_p])            # 2H -> H, no bias
    g = decoder_layer(h)                     # one Llama/Qwen3 layer, no input norm
    f_hat_{p+1} = g,  logits = lm_head(g)    # the target's embedding and LM head

so each drafted token comes with a predicted feature that feeds the next draft.
The checkpoint holds `fc.weight` and `layers.0.*` only (the layout of the EAGLE-1
heads vLLM loads); the embedding and LM head are the target's.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding (halves rotated), as Llama and Qwen3 use. x: [B, T, h, d]."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = positions.float()[..., None] * inv_freq  # [B, T, d/2]
    cos = torch.cat([angles.cos()] * 2, -1)[:, :, None, :]
    sin = torch.cat([angles.sin()] * 2, -1)[:, :, None, :]
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class EagleAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // self.num_heads
        self.theta = config.rope_parameters["rope_theta"]
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, positions, self.theta), rope(k, positions, self.theta)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            scale=1 / math.sqrt(self.head_dim),
            enable_gqa=True,
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class EagleMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class EagleLayer(nn.Module):
    """A decoder layer without the input norm (fc's output goes straight to attention)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.self_attn = EagleAttention(config)
        self.mlp = EagleMLP(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(x, positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleHead(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.layers = nn.ModuleList([EagleLayer(config)])

    def forward(
        self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """[B, T, H] embeddings of x_{p+1} and target features f_p -> predicted f_{p+1}."""
        return self.layers[0](self.fc(torch.cat([embeds, features], dim=-1)), positions)


def head_config(target_config):
    """The head's config: the target's, with one layer and an `Eagle...` architecture name."""
    values = target_config.to_dict()
    values["num_hidden_layers"] = 1
    if values.get("layer_types"):
        values["layer_types"] = values["layer_types"][:1]
    config = target_config.__class__.from_dict(values)
    config.architectures = [f"Eagle{target_config.architectures[0]}"]
    return config


def save_head(head: EagleHead, config, out: Path, card: str = "") -> None:
    """config.json and model.safetensors (float32) in `out`, plus a README when given."""
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    tensors = {name: p.detach().float().contiguous() for name, p in head.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # safetensors writes 0600; ship it world-readable
    if card:
        (out / "README.md").write_text(card)


def load_head(path: Path) -> EagleHead:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    head = EagleHead(AutoConfig.from_pretrained(path))
    head.load_state_dict(load_file(str(path / "model.safetensors")))
    return head.eval()
