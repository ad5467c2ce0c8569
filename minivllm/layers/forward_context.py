"""What the forward in progress needs besides its inputs, owned by the model runner."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from minivllm.layers.attention.backend import AttentionBackend


@dataclass(slots=True)
class ForwardContext:
    # the engine's attention backend and the metadata it built for this step
    attention: tuple[AttentionBackend, Any]


_current: ForwardContext | None = None


@contextmanager
def forward_context(context: ForwardContext) -> Iterator[None]:
    global _current
    if _current is not None:
        raise RuntimeError("forward contexts do not nest")
    _current = context
    try:
        yield
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention ran outside the model runner's forward context")
    return _current
