"""The multi-head latent attention layer (DeepSeek-V2/V3), sparse when it has an indexer (V3.2).

The model file computes the projections and rotations; this layer owns what lives in the
paged cache (the latent row [c_kv | k_pe] and the indexer's key per token) and hands
the step to the backend that serves `MLAAttentionSpec` (`sparse_mla_backend.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.layers.attention.kv_cache_spec import MLAAttentionSpec
from minivllm.layers.attention.layer import AttentionLayerBase
from minivllm.layers.forward_context import get_forward_context


class MLAAttention(AttentionLayerBase):
    """Heads are this rank's (TP splits them); the latent and indexer are replicated.

    `kv_b_proj` (kv_lora_rank -> heads x (qk_nope + v)) is the model's layer, used as it
    is by prefill and, for the absorbed decode, as two per-head matrices W_UK, W_UV read
    back through the layer itself (so a quantized `kv_b_proj` works unchanged). It is
    held outside the module tree: the model owns and loads it.
    """

    def __init__(
        self,
        num_heads: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        kv_lora_rank: int,
        scale: float,
        kv_b_proj: nn.Module,
        index_topk: int = 0,
        index_head_dim: int = 0,
        shared_index: bool = False,
    ) -> None:
        """`shared_index` (GLM-MoE-DSA's "shared" layers): sparse, but with no indexer
        of its own; the backend reuses the selection of the last full layer this step."""
        super().__init__()
        self.num_heads = num_heads
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = v_head_dim, kv_lora_rank
        self.scale = scale
        self.index_topk, self.index_head_dim = index_topk, index_head_dim
        self.index_scale = index_head_dim**-0.5 if index_head_dim else 0.0
        self.shared_index = shared_index
        object.__setattr__(self, "kv_b_proj", kv_b_proj)  # not a submodule: see above
        self._absorbed: tuple[torch.Tensor, torch.Tensor] | None = None
        self.layer_idx = 0  # among the model's MLA layers (HiSparse's host pool views)
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def is_sparse(self) -> bool:
        return self.index_topk > 0

    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> MLAAttentionSpec:
        return MLAAttentionSpec(
            block_size, dtype, self.kv_lora_rank, self.qk_rope_head_dim, self.index_head_dim
        )

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, kv_lora], W_UV [H, v, kv_lora]) of this rank's heads, computed
        once as kv_b_proj(I): exact for full-precision weights, the dequantized values
        for quantized ones."""
        if self._absorbed is None:
            proj = self.kv_b_proj
            eye = torch.eye(self.kv_lora_rank, dtype=torch.get_default_dtype())
            quantized_dtype = getattr(proj.quant_method, "dtype", None)
            if quantized_dtype is not None:
                # a quantized layer's tensors are integers and float32 scales: the
                # identity goes in the model's dtype, which its op takes and gives
                eye = eye.to(next(proj.parameters()).device, quantized_dtype)
            for p in [] if quantized_dtype is not None else proj.parameters():
                if p.is_floating_point():
                    # bf16 weight panels in an fp32 engine (layers/panel_linear.py) take
                    # and give fp32: the identity goes in the engine's dtype there
                    dtype = torch.float32 if p.dim() == 3 else p.dtype
                    eye = eye.to(p.device, dtype)
                    break
            with torch.no_grad():
                w = proj(eye).t().contiguous()  # [H * (nope + v), kv_lora]
            w = w.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, -1)
            self._absorbed = (
                w[:, : self.qk_nope_head_dim].contiguous(),
                w[:, self.qk_nope_head_dim :].contiguous(),
            )
        return self._absorbed

    def forward(
        self,
        q: torch.Tensor,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        index_q: torch.Tensor | None = None,
        index_k: torch.Tensor | None = None,
        index_w: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, H, nope + rope] (rotated); c_kv: [T, kv_lora] (normed); k_pe: [T, rope]
        (rotated); the indexer's q [T, Hi, Di], k [T, Di] (rotated) and head weights
        [T, Hi] (float32) when sparse -> [T, H * v_head_dim]."""
        backend, metadata = get_forward_context().attention
        out = backend.forward(
            self, q, c_kv, k_pe, index_q, index_k, index_w, self.kv_cache, metadata
        )
        return out.reshape(-1, self.num_heads * self.v_head_dim)
