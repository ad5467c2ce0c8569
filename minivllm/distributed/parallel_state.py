"""The tensor-parallel group: rank, size and the collectives the layers use.

With one process (the default) every collective is the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_TP_SIZE = 1
_TP_RANK = 0


def init_tensor_parallel(rank: int, size: int) -> None:
    """Record this process's place in the TP group (torch.distributed must be initialised)."""
    global _TP_SIZE, _TP_RANK
    _TP_RANK, _TP_SIZE = rank, size


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP_SIZE > 1:
        dist.all_reduce(x)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`."""
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)
