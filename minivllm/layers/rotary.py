"""Rotary position embeddings for every rope type the supported models use.

Inverse frequencies follow the published recipes, as transformers computes them:
linear interpolation (Chen et al. 2023, arXiv:2306.15595), dynamic NTK (bloc97,
reddit r/LocalLLaMA 2023), YaRN (Peng et al. 2023, arXiv:2309.00071), Llama 3.1's
frequency-banded scaling, and LongRoPE (Ding et al. 2024, arXiv:2402.13753).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from minivllm.kernels.registry import Kernels
from minivllm.layers.custom_op import CustomOp

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn(
    params: dict[str, Any], base: float, dim: int, max_pos: int
) -> tuple[torch.Tensor, float]:
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_pos / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(params.get("beta_fast") or 32)
    high = correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (
        1.0 / pos_freqs
    ) * extrapolation_weight
    return inv_freq, float(attention_factor)


def _llama3(params: dict[str, Any], base: float, dim: int) -> torch.Tensor:
    inv_freq = _base_inv_freq(base, dim)
    factor, low_ff, high_ff = (
        params["factor"],
        params["low_freq_factor"],
        params["high_freq_factor"],
    )
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > old_len / low_ff, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high_ff) * ~(wavelen > old_len / low_ff)
    return torch.where(is_medium, blended, scaled)


def _longrope(
    params: dict[str, Any], base: float, dim: int, max_pos: int, max_model_len: int
) -> tuple[torch.Tensor, float]:
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_pos / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    # transformers switches to the long factors once a sequence passes the original
    # length; one fixed choice keeps cached keys consistent, so we choose by max_model_len.
    ext = params["long_factor"] if max_model_len > original else params["short_factor"]
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(ext, dtype=torch.float32) * base**shape), float(attention_factor)


def compute_inv_freq(
    params: dict[str, Any], head_dim: int, max_pos: int, max_model_len: int
) -> tuple[torch.Tensor, float, int]:
    """(inverse frequencies, cos/sin scale, rotary dim) for a config's `rope_parameters`."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    base = params.get("rope_theta", 10000.0)
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    if rope_type == "default":
        return _base_inv_freq(base, dim), 1.0, dim
    if rope_type == "linear":
        return _base_inv_freq(base, dim) / params["factor"], 1.0, dim
    if rope_type == "dynamic":
        # NTK base stretch for sequences past max_pos; max_model_len never exceeds
        # max_pos, where the stretch is exactly 1, so this equals the default.
        seq_len = max(max_model_len, max_pos)
        factor = params["factor"]
        base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim), 1.0, dim
    if rope_type == "yarn":
        return (*_yarn(params, base, dim, max_pos), dim)
    if rope_type == "llama3":
        return _llama3(params, base, dim), 1.0, dim
    if rope_type == "longrope":
        return (*_longrope(params, base, dim, max_pos, max_model_len), dim)
    raise ValueError(f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")


class RotaryEmbedding(CustomOp):
    """Neox-style rotation (halves rotated) from a precomputed cos/sin cache."""

    def __init__(
        self, head_dim: int, params: dict[str, Any], max_pos: int, max_model_len: int
    ) -> None:
        super().__init__()
        inv_freq, scale, self.rotary_dim = compute_inv_freq(
            params, head_dim, max_pos, max_model_len
        )
        freqs = torch.outer(torch.arange(max_model_len, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos() * scale, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scale, persistent=False)
        # the compiled op, in place, and the dtype it takes (bf16 for the AVX512-BF16
        # family, float32 for the AVX2 one)
        self.rotary_op: Callable[..., None] | None = None
        self.kernel_dtype: torch.dtype | None = None

    def select_kernels(self, kernels: Kernels) -> None:
        self.rotary_op = kernels.op("rotary_inplace")
        self.kernel_dtype = kernels.key.dtype if kernels.key is not None else None

    @property
    def uses_kernels(self) -> bool:
        return self.rotary_op is not None

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, num_heads, head_dim], k: [T, num_kv_heads, head_dim]."""
        if self.rotary_op is not None and q.dtype == self.kernel_dtype:
            for x in (q, k):  # in place; heads of a row are contiguous
                self.rotary_op(x, positions, self.cos_cache, self.sin_cache)
            return q, k
        cos = self.cos_cache[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(q.dtype).unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """One tensor [T, heads, dim >= rotary_dim], rotated on its first `rotary_dim`
        values (plain PyTorch, out of place)."""
        cos = self.cos_cache[positions].to(x.dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(x.dtype).unsqueeze(1)
        return self._rotate(x, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated_half = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot * cos + rotated_half * sin
        return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)
