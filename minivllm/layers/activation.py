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
        self.op: Callable[[torch.Tensor], torch.Tensor] | None = None  # compiled bf16 op

    def select_kernels(self, kernels: Kernels) -> None:
        self.op = kernels.op("silu_and_mul")

    @property
    def uses_kernels(self) -> bool:
        return self.op is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.op is not None and x.dtype == torch.bfloat16:
            return self.op(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
