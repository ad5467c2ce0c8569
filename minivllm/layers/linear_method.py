"""How a linear layer holds and applies its weight: the quantization seam.

Every linear layer and the LM head own a `LinearMethodBase`, chosen at
construction, and call it in three steps (vLLM's `LinearMethodBase` contract):

    create_weights(layer, ...)            at construction: the parameters a checkpoint fills
    process_weights_after_loading(layer)  once, after the loader filled them: repack, quantize
    apply(layer, x, bias)                 every forward

A quantization scheme is one more subclass in its own file (`quantization/`);
model files never name one. The compiled op that does the arithmetic is not the
method's choice alone: `process_weights_after_loading` receives the engine's
`Kernels` and picks the fastest op those give for its weight format.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.kernels.registry import Kernels
from minivllm.layers.cpu_linear import CpuLinearKernel
from minivllm.layers.panel_linear import PanelLinear, exactly_bf16, pack_panels
from minivllm.utils.memory import own_mapping_empty

WeightLoader = Callable[..., None]


class WeakLoader:
    """A parameter's `weight_loader`: its module's method, held weakly. A bound method
    stored on the parameter would close the cycle module -> parameter -> method -> module,
    which only Python's cyclic collector frees, so a dropped engine's weights (GBs) would
    stay resident until it happened to run."""

    __slots__ = ("_method",)

    def __init__(self, method: WeightLoader) -> None:
        self._method = weakref.WeakMethod(method)

    def __call__(self, *args: object) -> None:
        return self._method()(*args)


class LinearMethodBase(ABC):
    @abstractmethod
    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, weight_loader: WeightLoader
    ) -> None:
        """Register the layer's weight parameter(s), each with `weight_loader` attached."""

    def process_weights_after_loading(self, layer: nn.Module, kernels: Kernels) -> None:
        """Turn the loaded checkpoint tensors into what `apply` reads (default: nothing to do)."""
        return

    # Whether `process_weights_after_mapping` exists: the weight cache refuses the model otherwise.
    supports_mapped_weights = False

    def process_weights_after_mapping(self, layer: nn.Module, kernels: Kernels) -> None:
        """The weights arrive already processed and read-only (`load_format="ipc_cache"`):
        rebuild only the Python-side state `apply` needs, writing to no weight."""
        raise NotImplementedError(f"{type(self).__name__} cannot take mapped weights")

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x @ W.T + bias` for this method's weight format."""


def create_full_precision_weight(
    layer: nn.Module, input_size: int, output_size: int, weight_loader: WeightLoader
) -> None:
    """The checkpoint's weight in the model dtype, as the unquantized method and online
    quantization (before it quantizes) both hold it. On the CPU it sits on a mapping of
    its own, as glibc places any allocation over 32 MiB: whatever replaces it later (online
    quantization, layer by layer: loader/streamed_quantization.py; panels; a mapped
    copy) hands its pages straight back to the kernel instead of leaving a hole in the
    heap that later allocations would fault in page by page."""
    data = own_mapping_empty((output_size, input_size), torch.get_default_dtype())
    weight = nn.Parameter(data, requires_grad=False)
    weight.weight_loader = weight_loader
    layer.register_parameter("weight", weight)


class UnquantizedLinearMethod(LinearMethodBase):
    """Weights in the model's dtype. On a bf16 CPU with the kernels, small batches stream
    the weight through our GEMV kernel and large ones use a oneDNN-prepacked copy
    (`layers/cpu_linear.py`). In an fp32 engine on the AVX2 kernels, a weight whose values
    are all bf16 (a bf16 checkpoint's) is held as bf16 panels (`layers/panel_linear.py`):
    `layer.weight` is then the panels. Elsewhere `F.linear`."""

    def __init__(self) -> None:
        self.cpu_kernel: CpuLinearKernel | None = None
        self.panel_kernel: PanelLinear | None = None

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, weight_loader: WeightLoader
    ) -> None:
        create_full_precision_weight(layer, input_size, output_size, weight_loader)

    def process_weights_after_loading(self, layer: nn.Module, kernels: Kernels) -> None:
        gemv = kernels.op("gemv_bf16")
        if gemv is not None and layer.weight.dtype == torch.bfloat16:
            self.cpu_kernel = CpuLinearKernel.build(gemv, layer.weight, kernels.prepack_weights)
        panels_op = kernels.op("linear_bf16w")
        weight = layer.weight
        if panels_op is not None and weight.dtype == torch.float32 and exactly_bf16(weight):
            layer.register_parameter(
                "weight", nn.Parameter(pack_panels(weight.data), requires_grad=False)
            )
            self.panel_kernel = PanelLinear(panels_op, weight.shape[0])

    # Nothing above writes to the weight: the oneDNN-prepacked copy, where made, is new
    # memory built from it, and the panels replace the parameter. A mapped (read-only)
    # weight is already what this engine would have built: only the kernel objects are new.
    supports_mapped_weights = True

    def process_weights_after_mapping(self, layer: nn.Module, kernels: Kernels) -> None:
        panels_op = kernels.op("linear_bf16w")
        if panels_op is not None and layer.weight.dim() == 3:  # the daemon packed it
            # output_size: a linear layer's, or an LM head's vocabulary shard
            self.panel_kernel = PanelLinear(panels_op, layer.output_size)
            return
        self.process_weights_after_loading(layer, kernels)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.panel_kernel is not None:
            return self.panel_kernel(x, layer.weight, bias)
        if self.cpu_kernel is not None:
            return self.cpu_kernel(x, layer.weight, bias)
        return F.linear(x, layer.weight, bias)
