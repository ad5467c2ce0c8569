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

On CPUs with AMX-BF16 (Sapphire Rapids and later) oneDNN's GEMM runs on the tile unit
and overtakes our kernel after a few rows: on a 2-vCPU Xeon (2026-12-05, the 0.6B
shape's linears and its 151,936-row LM head, weights cycled from memory, ms per call,
`python benchmarks/bf16_linear_rows.py`) the prepacked copy was level at 4 rows (qkv
0.34 vs 0.32, head 11.6 vs 10.3) and 2.6x ahead at 16 (qkv 0.83 vs 0.32, head 28.1 vs
10.2), plain `F.linear` level at 8 and 1.7x ahead at 16 (`kernel_row_limits`). A
batch-16 decode step of an int8_w8a8 engine had spent 31 of its 63 ms in the bf16 LM head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minivllm.kernels.isa import cpu_flags

# rows up to which our kernel beats oneDNN: on plain weights, and on prepacked ones;
# then the same where oneDNN has AMX-BF16 tiles
MAX_KERNEL_ROWS = 64
MAX_KERNEL_ROWS_PACKED = 16
MAX_KERNEL_ROWS_AMX = 8
MAX_KERNEL_ROWS_PACKED_AMX = 4
PACK_BATCH_HINT = 128  # the batch size oneDNN picks its packed layout for


def kernel_row_limits() -> tuple[int, int]:
    """(plain weights, prepacked ones): the rows up to which our kernel runs on this CPU."""
    if "amx_bf16" in cpu_flags():
        return MAX_KERNEL_ROWS_AMX, MAX_KERNEL_ROWS_PACKED_AMX
    return MAX_KERNEL_ROWS, MAX_KERNEL_ROWS_PACKED


@dataclass(slots=True)
class CpuLinearKernel:
    """`x @ W.T + b` for one bf16 weight: our GEMV kernel up to `max_rows` rows, then
    oneDNN, on the prepacked copy where there is one."""

    gemv: Callable[..., torch.Tensor]
    packed_weight: torch.Tensor | None = None
    max_rows: int = MAX_KERNEL_ROWS

    @classmethod
    def build(
        cls, gemv: Callable[..., torch.Tensor], weight: torch.Tensor, prepack: bool
    ) -> CpuLinearKernel:
        packed = None
        if prepack and torch.backends.mkldnn.is_available():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
        plain, prepacked = kernel_row_limits()
        return cls(gemv, packed, plain if packed is None else prepacked)

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if x.dtype != torch.bfloat16 or rows.shape[0] == 0:  # 0 rows: a step that samples none
            return F.linear(x, weight, bias)
        packed = self.packed_weight
        if rows.shape[0] <= self.max_rows:
            return self.gemv(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return F.linear(x, weight, bias)


def fits_prepacked(weight_bytes: int, available_bytes: int) -> bool:
    """Whether a prepacked copy of `weight_bytes` of linear weights fits in an eighth of
    `available_bytes` (and oneDNN is there to use it)."""
    return 0 < weight_bytes <= available_bytes // 8 and torch.backends.mkldnn.is_available()
