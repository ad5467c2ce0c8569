"""Attention backends by name, and the choice made once per engine.

A new backend is its own file plus one line in `_BACKENDS` (or one call of
`register_attention_backend`, as the tests' toy backend does).
"""

from __future__ import annotations

from collections.abc import Callable

from minivllm.kernels.registry import Kernels
from minivllm.layers.attention.backend import AttentionBackend
from minivllm.layers.attention.cpu_backend import CpuAttentionBackend
from minivllm.layers.attention.kv_cache_spec import FullAttentionSpec, KVCacheSpec, MLAAttentionSpec
from minivllm.layers.attention.sparse_mla_backend import SparseMLABackend
from minivllm.layers.attention.torch_backend import TorchAttentionBackend

# name -> factory(kernels, decode_query_len)
BackendFactory = Callable[[Kernels, int], AttentionBackend]
_BACKENDS: dict[str, BackendFactory] = {
    "torch": lambda kernels, decode_query_len: TorchAttentionBackend(decode_query_len),
    "cpu": CpuAttentionBackend,
    "sparse_mla": lambda kernels, decode_query_len: SparseMLABackend(decode_query_len, kernels),
}


def register_attention_backend(name: str, factory: BackendFactory) -> None:
    _BACKENDS[name] = factory


def attention_backend_names() -> list[str]:
    return sorted(_BACKENDS)


def select_attention_backend(
    name: str | None,
    kernels: Kernels,
    decode_query_len: int = 1,
    spec_type: type[KVCacheSpec] = FullAttentionSpec,
) -> AttentionBackend:
    """`name` if given; else, for the model's kind of cache (`spec_type`), the compiled
    CPU kernels where this engine has them, else the plain PyTorch backend."""
    if name is None:
        if issubclass(spec_type, MLAAttentionSpec):
            name = "sparse_mla"
        else:
            name = "cpu" if kernels.op("paged_attention_decode") is not None else "torch"
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {', '.join(attention_backend_names())}"
        )
    backend = _BACKENDS[name](kernels, decode_query_len)
    if backend.spec_types and not issubclass(spec_type, backend.spec_types):
        raise ValueError(
            f"attention backend {name!r} cannot serve this model's {spec_type.__name__} layers; "
            "leave attention_backend unset to pick one that can"
        )
    return backend
