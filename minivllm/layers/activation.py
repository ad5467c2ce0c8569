"""Gated activations."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:] for the merged gate/up projection."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels: ModuleType | None = None  # fused bf16 CPU ops, set by the model runner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.dtype == torch.bfloat16:
            return self.kernels.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
