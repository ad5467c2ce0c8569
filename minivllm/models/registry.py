"""A lazy registry: HF `architectures` name -> model class, imported on first use."""

from __future__ import annotations

import importlib

from torch import nn

_MODELS = {
    "DeepseekV32ForCausalLM": ("deepseek_v32", "DeepseekV32ForCausalLM"),
    "GlmMoeDsaForCausalLM": ("deepseek_v32", "GlmMoeDsaForCausalLM"),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(architectures: list[str] | None) -> type[nn.Module]:
    for arch in architectures or []:
        if arch in _MODELS:
            module, name = _MODELS[arch]
            return getattr(importlib.import_module(f"minivllm.models.{module}"), name)
    if any(arch.startswith("Eagle") for arch in architectures or []):
        raise ValueError(
            f"this checkpoint ({architectures}) is an EAGLE draft head, not a model: serve its "
            "target and pass the head as speculative_config={'method': 'eagle', 'model': ...}"
        )
    raise ValueError(
        f"model architecture {architectures} is not supported; "
        f"supported: {', '.join(supported_architectures())}"
    )
