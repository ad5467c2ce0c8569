"""RMSNorm, computed in float32 like the reference implementations."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from minivllm.kernels.registry import Kernels
from minivllm.layers.custom_op import CustomOp


class RMSNorm(CustomOp):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        # compiled ops, if the engine's kernels have them, and the dtype they take (bf16
        # for the AVX512-BF16 family, float32 for the AVX2 one)
        self.rms_norm_op: Callable[..., torch.Tensor] | None = None
        self.add_rms_norm_op: Callable[..., torch.Tensor] | None = None
        self.kernel_dtype: torch.dtype | None = None

    def select_kernels(self, kernels: Kernels) -> None:
        self.rms_norm_op = kernels.op("rms_norm")
        self.add_rms_norm_op = kernels.op("fused_add_rms_norm")
        self.kernel_dtype = kernels.key.dtype if kernels.key is not None else None

    @property
    def uses_kernels(self) -> bool:
        return self.rms_norm_op is not None and self.add_rms_norm_op is not None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise `x`; given `residual`, normalise `x + residual` and also return that sum."""
        if self.uses_kernels and x.dtype == self.kernel_dtype == self.weight.dtype:
            if residual is None:
                return self.rms_norm_op(x, self.weight, self.eps)
            residual = residual.contiguous()
            return self.add_rms_norm_op(x.contiguous(), residual, self.weight, self.eps), residual
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(dtype)
        return out if residual is None else (out, residual)
