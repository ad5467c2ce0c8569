"""Build a model from its config and fill it from the checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from minivllm.config import ModelConfig
from minivllm.loader.safetensors_loader import iterate_weights
from minivllm.models.registry import resolve_model_class


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(config: ModelConfig, device: str) -> nn.Module:
    model_cls = resolve_model_class(getattr(config.hf_config, "architectures", None))
    with torch.device(device), _default_dtype(config.dtype):
        model = model_cls(config.hf_config, config.max_model_len)
    model.load_weights(iterate_weights(config.model))
    return model.eval()
