"""The bf16 CPU linear backend: small batches stream weights through our AVX512-BF16 kernel.

Stock `F.linear` reads bf16 weights at roughly half the memory bandwidth for
one-row inputs; decode at small batch is bandwidth-bound, so this is where
batch-1 tokens/s is won. Larger inputs are compute-bound and go to oneDNN.

oneDNN is faster on weights it has re-laid out for itself ("prepacked", as
vLLM's CPU backend keeps them): measured on this project's 2-core Zen 4 VM over
the 0.6B shape's linears, 0.43 against 0.39 TFLOP/s at 128 rows, 0.41 against
0.37 (our kernel) at 64, 0.38 against 0.35 at 32, a tie at 16. The packed
layout is opaque, so our kernel cannot read it, and it is kept beside the plain
weights: one more copy of the linear weights, made only where it fits in an
eighth of the memory available at load (`pack_weights`). Without it, our kernel
takes up to 64 rows and stock `F.linear` the rest.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.layers.linear import LinearBase, UnquantizedLinearMethod

logger = logging.getLogger("minivllm")

# rows up to which our kernel beats oneDNN: on plain weights, and on prepacked ones
MAX_KERNEL_ROWS = 64
MAX_KERNEL_ROWS_PACKED = 16
PACK_BATCH_HINT = 128  # the batch size oneDNN picks its packed layout for


class CpuGemvLinearMethod(UnquantizedLinearMethod):
    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.matmul(x, layer.weight, bias, getattr(layer, "packed_weight", None))

    def matmul(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        packed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if x.dtype != torch.bfloat16:
            return F.linear(x, weight, bias)
        if rows.shape[0] <= (MAX_KERNEL_ROWS if packed is None else MAX_KERNEL_ROWS_PACKED):
            return self.kernels.gemv_bf16(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return F.linear(x, weight, bias)


def pack_weights(linears: list[nn.Module], available_bytes: int) -> int:
    """Give each linear a oneDNN-prepacked copy of its weight (`packed_weight`), if they
    fit in an eighth of `available_bytes`; returns the bytes added (0: not packed)."""
    total = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    if total == 0 or total > available_bytes // 8 or not torch.backends.mkldnn.is_available():
        return 0
    for module in linears:
        module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(
            module.weight.detach(), PACK_BATCH_HINT
        )
    return total


def use_cpu_kernels(model: nn.Module, kernels: ModuleType, available_bytes: int) -> int:
    """Switch a bf16 CPU model to the kernels: linears and LM head, norms, rotary, activation."""
    method = CpuGemvLinearMethod(kernels)
    linears = []
    for module in model.modules():
        if isinstance(module, LinearBase) and type(module.quant_method) is UnquantizedLinearMethod:
            module.quant_method = method
            linears.append(module)
        elif hasattr(module, "compute_logits") and hasattr(module, "linear_method"):
            module.linear_method = method
            linears.append(module)
        elif hasattr(module, "kernels"):
            module.kernels = kernels
    packed = pack_weights(linears, available_bytes)
    if packed:
        logger.info(
            "oneDNN-prepacked copies of the linear and LM-head weights for batches over %d rows "
            "(+%.2f GiB)",
            MAX_KERNEL_ROWS_PACKED,
            packed / 2**30,
        )
    return len(linears)
