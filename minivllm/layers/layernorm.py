"""RMSNorm, computed in float32 like the reference implementations."""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.kernels: ModuleType | None = None  # fused bf16 CPU ops, set by the model runner

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise `x`; given `residual`, normalise `x + residual` and also return that sum."""
        if self.kernels is not None and x.dtype == torch.bfloat16:
            if residual is None:
                return self.kernels.rms_norm(x, self.weight, self.eps)
            residual = residual.contiguous()
            return self.kernels.fused_add_rms_norm(
                x.contiguous(), residual, self.weight, self.eps
            ), residual
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(dtype)
        return out if residual is None else (out, residual)
