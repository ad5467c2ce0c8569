"""The bf16 CPU linear kernel: small batches stream weights through our AVX512-BF16 GEMV.

Stock `F.linear` reads bf16 weights at roughly half the memory bandwidth for
one-row inputs; decode at small batch is bandwidth-bound, so this is where
batch-1 tokens/s is won. Larger inputs are compute-bound and go to oneDNN.

oneDNN is faster on weights it has re-laid out for itself ("prepacked", as
vLLM's CPU backend keeps them): measured on this project's 2-core Zen 4 VM over
the 0.6B shape's linears, 0.43 against 0.39 TFLOP/s at 128 rows, 0.41 against
0.37 (our kernel) at 64, 0.38 against 0.35 at 32, a tie at 16. The packed
layout is opaque, so our kernel cannot read it, and it is kept beside the plain
weights: one more copy of the linear weights, made only where all of them fit in
an eighth of the memory available at load (`fits_prepacked`, decided once for
the model by the model runner). Without it, our kernel takes up to 64 rows and
stock `F.linear` the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# rows up to which our kernel beats oneDNN: on plain weights, and on prepacked ones
MAX_KERNEL_ROWS = 64
MAX_KERNEL_ROWS_PACKED = 16
PACK_BATCH_HINT = 128  # the batch size oneDNN picks its packed layout for


@dataclass(slots=True)
class CpuLinearKernel:
    """`x @ W.T + b` for one bf16 weight: our GEMV kernel, or oneDNN on the prepacked copy."""

    gemv: Callable[..., torch.Tensor]
    packed_weight: torch.Tensor | None = None

    @classmethod
    def build(
        cls, gemv: Callable[..., torch.Tensor], weight: torch.Tensor, prepack: bool
    ) -> CpuLinearKernel:
        packed = None
        if prepack and torch.backends.mkldnn.is_available():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
        return cls(gemv, packed)

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if x.dtype != torch.bfloat16 or rows.shape[0] == 0:  # 0 rows: a step that samples none
            return F.linear(x, weight, bias)
        packed = self.packed_weight
        if rows.shape[0] <= (MAX_KERNEL_ROWS if packed is None else MAX_KERNEL_ROWS_PACKED):
            return self.gemv(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return F.linear(x, weight, bias)


def fits_prepacked(weight_bytes: int, available_bytes: int) -> bool:
    """Whether a prepacked copy of `weight_bytes` of linear weights fits in an eighth of
    `available_bytes` (and oneDNN is there to use it)."""
    return 0 < weight_bytes <= available_bytes // 8 and torch.backends.mkldnn.is_available()
