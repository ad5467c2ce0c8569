"""Attention backends by name, and the choice made once per engine.

A new backend is its own file plus one line in `_BACKENDS` (or one call of
`register_attention_backend`, as the tests' toy backend does).
"""

from __future__ import annotations

from collections.abc import Callable

from minivllm.kernels.registry import Kernels
from minivllm.layers.attention.backend import AttentionBackend
from minivllm.layers.attention.cpu_backend import CpuAttentionBackend
from minivllm.layers.attention.torch_backend import TorchAttentionBackend

# name -> factory(kernels, decode_query_len)
BackendFactory = Callable[[Kernels, int], AttentionBackend]
_BACKENDS: dict[str, BackendFactory] = {
    "torch": lambda kernels, decode_query_len: TorchAttentionBackend(decode_query_len),
    "cpu": CpuAttentionBackend,
}


def register_attention_backend(name: str, factory: BackendFactory) -> None:
    _BACKENDS[name] = factory


def attention_backend_names() -> list[str]:
    return sorted(_BACKENDS)


def select_attention_backend(
    name: str | None, kernels: Kernels, decode_query_len: int = 1
) -> AttentionBackend:
    """`name` if given; else the compiled CPU kernels where this engine has them, else torch."""
    if name is None:
        name = "cpu" if kernels.op("paged_attention_decode") is not None else "torch"
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {', '.join(attention_backend_names())}"
        )
    return _BACKENDS[name](kernels, decode_query_len)
