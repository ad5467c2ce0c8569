"""Gated activations."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from minivllm.kernels.registry import Kernels
from minivllm.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    """silu(x[..., :d]) * x[..., d:] for the merged gate/up projection."""

    def __init__(self) -> None:
        super().__init__()
        self.op: Callable[[torch.Tensor], torch.Tensor] | None = None  # compiled op
        self.kernel_dtype: torch.dtype | None = None  # what it takes (bf16, or fp32 on AVX2)

    def select_kernels(self, kernels: Kernels) -> None:
        self.op = kernels.op("silu_and_mul")
        self.kernel_dtype = kernels.key.dtype if kernels.key is not None else None

    @property
    def uses_kernels(self) -> bool:
        return self.op is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.op is not None and x.dtype == self.kernel_dtype:
            return self.op(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
