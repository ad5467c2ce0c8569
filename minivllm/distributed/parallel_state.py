"""The tensor-parallel group: rank, size and the collectives the layers use.

With one process (the default) every collective is the identity. A TP rank
(`minivllm.worker.worker`) joins two groups over torch.distributed:

    cpu_group     gloo           the driver's calls, as pickled objects; waits for
                                 the next step without a deadline (an idle server)
    device_group  gloo on CPU,   activations: the all-reduce of row-parallel
                  NCCL on CUDA   layers, the logits all-gather, sampled tokens
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# How long a rank waits for the driver's next call: an idle server waits for good.
_NO_DEADLINE = timedelta(days=3650)


@dataclass(slots=True)
class _TensorParallelState:
    rank: int = 0
    size: int = 1
    cpu_group: Any = None
    device_group: Any = None


_tp = _TensorParallelState()


def init_tensor_parallel(rank: int, size: int, init_method: str) -> None:
    """Join the world (`init_method` is `tcp://host:port`); only the control group exists yet.

    The device group comes with `init_device_group`, once the rank knows its device.
    """
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=size, timeout=_NO_DEADLINE
    )
    _tp.rank, _tp.size, _tp.cpu_group = rank, size, dist.group.WORLD


def init_device_group(device: str) -> None:
    _tp.device_group = dist.new_group(backend="nccl" if device == "cuda" else "gloo")


def destroy_tensor_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    _tp.rank, _tp.size, _tp.cpu_group, _tp.device_group = 0, 1, None, None


def get_tp_rank() -> int:
    return _tp.rank


def get_tp_size() -> int:
    return _tp.size


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _tp.size > 1:
        dist.all_reduce(x, group=_tp.device_group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`."""
    if _tp.size == 1:
        return x
    if x.numel() == 0:  # a step with no logits rows: same shape on every rank, nothing to send
        return torch.cat([x] * _tp.size, dim=dim)
    parts = [torch.empty_like(x) for _ in range(_tp.size)]
    dist.all_gather(parts, x.contiguous(), group=_tp.device_group)
    return torch.cat(parts, dim=dim)


def tp_broadcast(x: torch.Tensor) -> torch.Tensor:
    """Every rank gets rank 0's `x` (same shape and dtype on all ranks)."""
    if _tp.size > 1:
        dist.broadcast(x, src=0, group=_tp.device_group)
    return x


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` (any picklable value) on every rank; others pass anything."""
    if _tp.size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_tp.cpu_group)
    return box[0]


def all_reduce_min(value: int) -> int:
    """The smallest `value` over all ranks (control group)."""
    if _tp.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_tp.cpu_group)
    return int(t.item())
