"""The bf16 CPU linear backend: decode-sized inputs stream weights through our AVX512-BF16 kernel.

Stock `F.linear` reads bf16 weights at roughly half the memory bandwidth for
one-row inputs; decode at small batch is bandwidth-bound, so this is where
batch-1 tokens/s is won. Larger inputs (prefill) stay on oneDNN/MKL.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.layers.linear import LinearBase, UnquantizedLinearMethod


class CpuGemvLinearMethod(UnquantizedLinearMethod):
    def __init__(self, kernels: ModuleType, max_rows: int = 64) -> None:
        self.kernels = kernels
        self.max_rows = max_rows

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.matmul(x, layer.weight, bias)

    def matmul(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] > self.max_rows or x.dtype != torch.bfloat16:
            return F.linear(x, weight, bias)
        return self.kernels.gemv_bf16(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])


def use_cpu_kernels(model: nn.Module, kernels: ModuleType) -> int:
    """Switch a bf16 CPU model to the kernels: linears and LM head, norms, rotary, activation."""
    method = CpuGemvLinearMethod(kernels)
    count = 0
    for module in model.modules():
        if isinstance(module, LinearBase) and type(module.quant_method) is UnquantizedLinearMethod:
            module.quant_method = method
            count += 1
        elif hasattr(module, "compute_logits") and hasattr(module, "linear_method"):
            module.linear_method = method
            count += 1
        elif hasattr(module, "kernels"):
            module.kernels = kernels
    return count
