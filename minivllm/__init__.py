"""minivllm: a compact, readable LLM inference and serving engine with vLLM's interface."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "TokensPrompt", "RequestOutput", "CompletionOutput", "Logprob"]

# Resolved on first use (PEP 562): `import minivllm` and `minivllm --help` stay free of torch.
_LAZY = {
    "LLM": "minivllm.llm",
    "SamplingParams": "minivllm.sampling_params",
    "TokensPrompt": "minivllm.outputs",
    "RequestOutput": "minivllm.outputs",
    "CompletionOutput": "minivllm.outputs",
    "Logprob": "minivllm.outputs",
}

if TYPE_CHECKING:
    from minivllm.llm import LLM
    from minivllm.outputs import CompletionOutput, Logprob, RequestOutput, TokensPrompt
    from minivllm.sampling_params import SamplingParams


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'minivllm' has no attribute {name!r}")
