"""The AVX2 linear: an fp32 engine whose linear weights are held as bf16 "panels".

CPUs without AVX512-BF16 run minivllm in float32 (`config.resolve_dtype`): they have no
bf16 arithmetic, and a bf16 matmul there converts every weight at every call. But a
bf16 checkpoint's weights are bf16 values; widened to fp32 they carry no more
information. So where a weight survives the round trip fp32 -> bf16 -> fp32 unchanged,
the engine keeps it as bf16 and our AVX2 kernel (`kernels/avx2_linear.cpp`) widens it
in registers: a decode step streams half the bytes, the weights take half the memory,
and every product is still computed in fp32 on exactly the checkpoint's values. A
weight that is not exactly bf16 (an fp32 checkpoint) stays fp32 on `F.linear`.

The layout: output rows 16 at a time ("panels", zero rows past N), each panel k-major,
its 16 weights at step k stored as 8 pairs: pair j = (row j, row 8 + j). The kernel's
one 256-bit load then yields rows 0-7 by a shift and rows 8-15 by a mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

PANEL = 16
# row order inside a panel: pair j is (row j, row 8 + j)
_PAIR_ORDER = torch.arange(PANEL).view(2, 8).T.reshape(-1)
_POSITION_OF_ROW = torch.argsort(_PAIR_ORDER)


def exactly_bf16(weight: torch.Tensor) -> bool:
    """Whether every value of `weight` is a bf16 value (the panels would hold it exactly)."""
    if weight.dtype == torch.bfloat16:
        return True
    if weight.dtype != torch.float32:
        return False
    # the low 16 bits of each fp32 are zero exactly when it is a bf16 value
    return not bool((weight.view(torch.int32) & 0xFFFF).any())


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] (values exactly bf16) -> [ceil(N / 16), K, 16] bf16 in the kernel's layout."""
    n, k = weight.shape
    num_panels = -(-n // PANEL)
    padded = torch.zeros(num_panels * PANEL, k, dtype=torch.bfloat16)
    padded[:n] = weight.to(torch.bfloat16)
    panels = padded.view(num_panels, PANEL, k)[:, _PAIR_ORDER, :]
    return panels.transpose(1, 2).contiguous()


def unpack_panels(panels: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of `pack_panels`, as fp32 [N, K] (for tests)."""
    num_panels, k, _ = panels.shape
    rows = torch.empty(num_panels, PANEL, k, dtype=torch.float32)
    rows[:, _PAIR_ORDER, :] = panels.transpose(1, 2).float()
    return rows.reshape(num_panels * PANEL, k)[:n]


def panel_rows(panels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight as fp32 [*ids.shape, K]: the lookup of a tied embedding
    table whose LM head holds the panels (the table is then not kept twice)."""
    flat = ids.reshape(-1)
    rows = panels[flat // PANEL, :, _POSITION_OF_ROW[flat % PANEL]]  # [T, K]
    return rows.float().view(*ids.shape, panels.shape[1])


@dataclass(slots=True)
class PanelLinear:
    """`x @ W.T + b` over a layer's panels with the AVX2 kernel; `n` is the layer's output size."""

    op: Callable[..., torch.Tensor]
    n: int

    def __call__(
        self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.dtype != torch.float32:
            rows = rows.float()
        out = self.op(rows, panels, self.n, bias)
        return out.view(*x.shape[:-1], self.n).to(x.dtype)
