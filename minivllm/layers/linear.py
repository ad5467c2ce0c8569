"""Linear layers that may be split across tensor-parallel ranks.

Every parameter carries a `weight_loader(param, loaded_weight, shard_id=None)`
that copies its rank's slice of a checkpoint tensor, so model files only wire
layers together. The weight's format and the math are delegated to
`quant_method`, a `LinearMethodBase` (the quantization seam, `linear_method.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_reduce
from minivllm.layers.linear_method import LinearMethodBase, UnquantizedLinearMethod, WeakLoader


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by tensor_parallel_size {denominator}")
    return numerator // denominator


class LinearBase(nn.Module):
    """A linear layer of this rank's shape; `quant_method` (default: unquantized) owns the weight."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        quant_method: LinearMethodBase | None = None,
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size, self.output_size = input_size, output_size
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(
            self, input_size, output_size, WeakLoader(self.weight_loader)
        )
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = WeakLoader(self.weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def weight_loader_ref(self) -> WeakLoader:
        """This layer's loader as parameters hold it, for a method that re-creates them."""
        return WeakLoader(self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        _copy_checked(param.data, loaded)


class ReplicatedLinear(LinearBase):
    pass


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        quant_method: LinearMethodBase | None = None,
    ) -> None:
        super().__init__(input_size, divide(output_size, get_tp_size()), bias, quant_method)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        size = param.shape[0]
        _copy_checked(param.data, loaded.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections in one matrix (gate and up): shard_id is the index."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        quant_method: LinearMethodBase | None = None,
    ) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, quant_method)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        assert isinstance(shard_id, int)
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        shard = loaded.narrow(0, self.tp_rank * size, size)
        _copy_checked(param.data.narrow(0, offset, size), shard)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix; heads split across ranks.

    With fewer KV heads than ranks, each KV head is replicated on
    `tp_size // num_kv_heads` consecutive ranks.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        quant_method: LinearMethodBase | None = None,
    ) -> None:
        tp_size = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp_size)
        if num_kv_heads >= tp_size:
            self.num_kv_heads = divide(num_kv_heads, tp_size)
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = divide(tp_size, num_kv_heads)
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output_size, bias, quant_method)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, rank = 0, q_size, self.tp_rank
        elif shard_id in ("k", "v"):
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, rank = kv_size, self.tp_rank // self.kv_replicas
        else:
            raise ValueError(f"QKV shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        _copy_checked(param.data.narrow(0, offset, size), loaded.narrow(0, rank * size, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial sums are all-reduced."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        quant_method: LinearMethodBase | None = None,
    ) -> None:
        super().__init__(divide(input_size, get_tp_size()), output_size, bias, quant_method)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        if param.dim() == 1:  # the bias is added once, after the reduction
            _copy_checked(param.data, loaded)
            return
        size = param.shape[1]
        _copy_checked(param.data, loaded.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None  # added once, after the reduction
        return tp_all_reduce(self.quant_method.apply(self, x, bias))


def _copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"checkpoint tensor has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
        )
    dst.copy_(src)


class Float32Linear(nn.Module):
    """A small replicated projection computed in float32 whatever the model's dtype: the
    MoE router and the DSA indexer's head weights, which the reference keeps in float32
    (`_keep_in_fp32_modules`). Not a `LinearBase`, so quantization never targets it."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(output_size, input_size, dtype=torch.float32), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.float(), self.weight)
