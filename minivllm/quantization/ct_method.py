"""The linear method of a layer a compressed-tensors checkpoint stores quantized.

It registers the checkpoint's own tensors (`weight` or `weight_packed`, `weight_scale`,
`weight_shape`, `weight_zero_point`) so the strict loader fills them, unpacking the
int32 words into one signed integer per weight element as they load: tensor-parallel
slicing and the fused q/k/v and gate/up layers then cut in element units, as they do
for full-precision weights. After loading, the values become our kernel layout
(`formats.QuantWeights`) without re-quantizing: the checkpoint's scales are kept.
The on-disk layout is described in `compressed_tensors.py`.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.distributed.parallel_state import get_tp_size
from minivllm.kernels.registry import Kernels
from minivllm.layers.embedding import VocabParallelEmbedding
from minivllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from minivllm.layers.linear_method import WeightLoader
from minivllm.quantization import formats
from minivllm.quantization.method import QuantizedLinearMethod


def unpack_int32(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """compressed-tensors' packing undone along the last dim: element i sits in bits
    [i*bits, i*bits + bits) of the words, stored as q + 2^(bits-1). Returns signed int8."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int32) * bits
    values = (words.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    values = values.reshape(*words.shape[:-1], -1)[..., :count]
    return (values - (1 << (bits - 1))).to(torch.int8)


class CompressedTensorsLinearMethod(QuantizedLinearMethod):
    def __init__(
        self,
        spec,
        backend: str | None = None,
        source: str = "online",
        per_tensor: bool = False,
        block: tuple[int, int] | None = None,
        scale_name: str = "weight_scale",
    ) -> None:
        super().__init__(spec, backend, source)
        self.per_tensor = per_tensor  # fp8: one scale per checkpoint tensor (shard)
        # fp8: one scale per block of (rows, k) [N / rows, K / k]; held per row and k group
        self.block = block
        self.scale_name = scale_name  # "weight_scale_inv" in transformers' fp8 checkpoints

    @property
    def group_size(self) -> int:
        return self.block[1] if self.block else super().group_size

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, weight_loader: WeightLoader
    ) -> None:
        spec = self.spec
        grouped = spec.scheme in formats.INT4_SCHEMES or self.block is not None
        if grouped and input_size % self.group_size:
            hint = " (a smaller tensor_parallel_size may)" if get_tp_size() > 1 else ""
            raise ValueError(
                f"the checkpoint's {spec.scheme} groups of {self.group_size} k do not divide "
                f"this rank's {input_size} input features{hint}"
            )
        replicate_scale = isinstance(layer, RowParallelLinear) and not grouped
        if spec.scheme == "fp8_w8a16":
            self._add(
                layer, "weight", (output_size, input_size), torch.float8_e4m3fn, weight_loader
            )
        elif self.source != "pack-quantized":
            self._add(layer, "weight", (output_size, input_size), torch.int8, weight_loader)
        else:
            bits = 4 if grouped else 8
            self._add(
                layer,
                "weight_packed",
                (output_size, input_size),
                torch.int8,
                _unpacking(weight_loader, bits, lambda t: t.shape[-1] * (32 // bits)),
            )
            shape = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
            shape.weight_loader = _check_shape
            shape.raw_checkpoint_tensor = True
            layer.register_parameter("weight_shape", shape)
        scale_cols = input_size // self.group_size if grouped else 1
        scale_loader = _copy_whole if replicate_scale else weight_loader
        if self.per_tensor:
            scale_loader = _per_tensor(scale_loader, layer)
        elif self.block is not None:
            scale_loader = _block_rows(scale_loader, layer, self.block)
        raw = self.per_tensor or self.block is not None  # their loaders check the dtype
        self._add(
            layer, self.scale_name, (output_size, scale_cols), torch.float32, scale_loader, raw=raw
        )
        if spec.scheme == "fp8_w8a16":
            # a static fp8 checkpoint's activation scales (`activation_scale` where
            # transformers saved it): read, not used (weight-only)
            for name in ("input_scale", "activation_scale"):
                self._add(layer, name, (0,), torch.float32, _ignore)
                getattr(layer, name).optional_checkpoint_tensor = True
        if self.per_tensor and self.source == "fp8":
            # transformers' fp8 format names a per-tensor scale `weight_scale_inv` where
            # vLLM's names it `weight_scale`: either fills the scale, and a missing one is
            # caught after loading (it stays NaN)
            main = getattr(layer, self.scale_name)
            main.data.fill_(float("nan"))
            main.optional_checkpoint_tensor = True
            alias = "weight_scale_inv" if self.scale_name == "weight_scale" else "weight_scale"
            self._add(layer, alias, (0,), torch.float32, _into(main, scale_loader))
            getattr(layer, alias).optional_checkpoint_tensor = True
        if grouped and not spec.symmetric:
            self._add(
                layer,
                "weight_zero_point",
                (output_size, scale_cols),
                torch.int8,
                _unpacking(weight_loader, 4, None, along_rows=True),
            )

    @staticmethod
    def _add(layer, name, shape, dtype, loader, raw: bool = True) -> None:
        param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        param.weight_loader = loader
        # the strict loader hands this tensor over as stored (no cast to the parameter's dtype)
        param.raw_checkpoint_tensor = raw
        layer.register_parameter(name, param)

    def process_weights_after_loading(self, layer: nn.Module, kernels: Kernels) -> None:
        spec = self.spec
        values = getattr(layer, "weight_packed", None)
        if values is None:
            values = layer.weight
        values = values.data
        scale = getattr(layer, self.scale_name).data
        if bool(scale.isnan().any()):
            raise ValueError(
                "a quantized layer's checkpoint holds no weight_scale (nor weight_scale_inv) "
                "for some of its rows"
            )
        if spec.scheme == "fp8_w8a16":
            per_row = scale if self.block else scale[:, 0]
            qw = formats.from_fp8_values(values, per_row, self.group_size)
        elif spec.scheme in formats.INT4_SCHEMES:  # signed [-8, 7] here, unsigned [0, 15] there
            zero = getattr(layer, "weight_zero_point", None)
            qw = formats.from_int4_values(
                (values.to(torch.int16) + 8).to(torch.uint8),
                scale,
                None if zero is None else zero.data.to(torch.float32) + 8,
                spec.group_size,
                spec.scheme,
            )
        else:
            qw = formats.from_int8_values(values, scale[:, 0], spec.scheme)
        self.install(layer, qw, kernels)


def _unpacking(loader: WeightLoader, bits: int, count, along_rows: bool = False) -> WeightLoader:
    """A loader that unpacks the checkpoint's int32 words, then slices as the layer does."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if along_rows and loaded.dtype == torch.int32:  # zero points packed down the outputs
            rows = loaded.shape[0] * (32 // bits)
            values = unpack_int32(loaded.t().contiguous(), bits, rows).t().contiguous()
        elif loaded.dtype == torch.int32:
            values = unpack_int32(loaded, bits, count(loaded))
        else:
            values = loaded
        loader(param, values, shard_id)

    return load


def checkpoint_rows(layer: nn.Module, shard_id: object) -> int:
    """The rows of the checkpoint tensor that `layer`'s loader takes for `shard_id`: a
    fused shard's whole output (q, k or v; gate or up), a column-parallel layer's or the
    LM head's across all ranks, else (replicated, row-parallel) the layer's own."""
    tp = get_tp_size()
    if isinstance(layer, QKVParallelLinear):
        if shard_id == "q":
            return layer.num_heads * tp * layer.head_dim
        return layer.num_kv_heads * tp // layer.kv_replicas * layer.head_dim
    if isinstance(layer, MergedColumnParallelLinear):
        return layer.output_sizes[shard_id]
    if isinstance(layer, ColumnParallelLinear):
        return layer.output_size * tp
    if isinstance(layer, VocabParallelEmbedding):
        return layer.vocab_size
    return layer.output_size


def _scale_values(loaded: torch.Tensor) -> torch.Tensor:
    """A checkpoint's scale tensor in float32: float32, bf16, fp16 or e8m0 (transformers'
    "ue8m0" scale format) are read as numbers; integers would be read as their bytes'
    values, so they are refused."""
    if not loaded.is_floating_point():
        raise ValueError(
            f"a weight scale stored as {loaded.dtype} is not a number minivllm reads "
            "(float32, bfloat16, float16 or float8_e8m0fnu)"
        )
    return loaded.to(torch.float32)


def _per_tensor(loader: WeightLoader, layer: nn.Module) -> WeightLoader:
    """A per-tensor scale as a per-channel one: the value repeated down the checkpoint
    tensor's rows, which the layer's own loader then cuts as it cuts the weight's."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if loaded.numel() != 1:
            raise ValueError(
                f"a per-tensor weight scale holds one value, got shape {tuple(loaded.shape)}"
            )
        rows = checkpoint_rows(layer, shard_id)
        loader(param, _scale_values(loaded).reshape(1, 1).expand(rows, 1), shard_id)

    return load


def _block_rows(loader: WeightLoader, layer: nn.Module, block: tuple[int, int]) -> WeightLoader:
    """Block scales [ceil(N / rows), ceil(K / k)] of the checkpoint tensor as the layer
    holds them, per row and k group: each block row repeated `rows` times down the
    output dimension and cut to N, then cut as the layer cuts the weight's rows."""
    rows, cols = block

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        n = checkpoint_rows(layer, shard_id)
        k = layer.input_size * (get_tp_size() if isinstance(layer, RowParallelLinear) else 1)
        expected = (-(-n // rows), -(-k // cols))
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"block scales of a [{n}, {k}] weight in {rows} x {cols} blocks have shape "
                f"{list(expected)}, got {list(loaded.shape)}"
            )
        per_row = _scale_values(loaded).repeat_interleave(rows, dim=0)[:n]
        loader(param, per_row, shard_id)

    return load


def _into(target: nn.Parameter, loader: WeightLoader) -> WeightLoader:
    """A loader for a second name of `target`'s tensor: it loads into `target`."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        loader(target, loaded, shard_id)

    return load


def _ignore(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    return


def _check_shape(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    """`weight_shape` is the full [N, K] of the checkpoint module: kept for the record only."""
    if loaded.numel() != 2:
        raise ValueError(f"weight_shape must hold [out, in], got shape {tuple(loaded.shape)}")


def _copy_whole(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    """A per-output-channel scale of a row-parallel layer: every rank has all N outputs."""
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(
            f"weight_scale has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}"
        )
    param.data.copy_(loaded)
