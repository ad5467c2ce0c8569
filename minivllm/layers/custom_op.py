"""Layers with a plain-PyTorch forward that may swap in compiled ops."""

from __future__ import annotations

from torch import nn

from minivllm.kernels.registry import Kernels


class CustomOp(nn.Module):
    """The loader calls `select_kernels` once the weights are in; each layer asks the
    engine's `Kernels` for the ops it can use and keeps its plain path for the rest."""

    def select_kernels(self, kernels: Kernels) -> None:
        raise NotImplementedError

    @property
    def uses_kernels(self) -> bool:
        raise NotImplementedError
