"""Give each layer of a freshly built model its quantization method, before the weights load.

Model files build every linear layer unquantized and never name a scheme; this walk
decides, by module name, which layers a pre-quantized checkpoint already holds in its
own format (those keep it) and which the online configuration quantizes (the rest),
and swaps their `quant_method`. It logs one line per scheme: how many layers of which
kind, from which pattern.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict

from torch import nn

from minivllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.linear import LinearBase
from minivllm.layers.moe import FusedMoE
from minivllm.quantization.config import QuantizationConfig

logger = logging.getLogger("minivllm")


def quantizable_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The linear layers, the routed experts, the LM head and the token embedding, by
    module name."""
    kinds = (LinearBase, VocabParallelEmbedding, FusedMoE)
    return [(n, m) for n, m in model.named_modules() if isinstance(m, kinds)]


def shard_names(model: nn.Module, name: str) -> list[str]:
    """The checkpoint module names a fused module is built from (`q_proj`, ...; a MoE
    layer's `experts.0.gate_proj` ... `experts.{E-1}.down_proj`), or []."""
    module = model.get_submodule(name) if name else model
    if isinstance(module, FusedMoE):
        return [
            f"{name}.{e}.{proj}"
            for e in range(module.num_experts)
            for proj in ("gate_proj", "up_proj", "down_proj")
        ]
    packed = getattr(model, "packed_modules", {})
    parent, _, leaf = name.rpartition(".")
    return [
        f"{parent}.{source}" if parent else source
        for source, (target, _) in packed.items()
        if target == leaf
    ]


def assign_quant_methods(
    model: nn.Module, config: QuantizationConfig | None, checkpoint=None
) -> None:
    """Swap in the quantized method of every layer the checkpoint or `config` quantizes.

    `checkpoint` (a `compressed_tensors.CheckpointQuantization`, or None) names the layers
    the checkpoint stores quantized; `config`'s targets apply to the others only."""
    from minivllm.quantization.checkpoint_moe import CheckpointMoEMethod
    from minivllm.quantization.method import QuantizedLinearMethod
    from minivllm.quantization.moe_method import QuantizedMoEMethod

    modules = quantizable_modules(model)
    backends = config.backends if config else {}
    chosen: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    partial_experts: dict[tuple[str, str], list[str]] = defaultdict(list)
    for name, module in modules:
        shards = shard_names(model, name)
        stored = checkpoint.spec_for(name, shards) if checkpoint is not None else None
        if stored is not None and isinstance(module, FusedMoE):
            method = CheckpointMoEMethod(stored, backends.get(stored.spec.scheme))
            method.create_weights(module, name)
            module.quant_method = method
            chosen[(str(stored), f"the checkpoint, {stored.format}")][_kind(name)] += 1
            continue
        if stored is not None:
            method = checkpoint.method_for(stored, backends.get(stored.spec.scheme))
            _swap(model, name, module, method, recreate=True)
            chosen[(str(stored), f"the checkpoint, {stored.format}")][_kind(name)] += 1
            continue
        if config is None or not config.targets:
            continue
        if isinstance(module, FusedMoE):
            hit, partial, ignored = config.spec_for_experts(name, shards)
            for pattern in partial:
                partial_experts[("quantization target", pattern)].append(name)
            for pattern in ignored:
                partial_experts[("`ignore` pattern", pattern)].append(name)
            if hit is not None:
                spec, pattern = hit
                module.quant_method = QuantizedMoEMethod(spec, backends.get(spec.scheme))
                module.quant_method.check_shape(module, name)
                chosen[(str(spec), f"target {pattern!r}")][_kind(name)] += 1
            continue
        hit = config.spec_for(name, shards)
        if hit is None:
            continue
        spec, pattern = hit
        _swap(model, name, module, QuantizedLinearMethod(spec, backends.get(spec.scheme)), False)
        chosen[(str(spec), f"target {pattern!r}")][_kind(name)] += 1
    if config is not None:
        names = [n for name, _ in modules for n in (name, *shard_names(model, name))]
        for pattern in config.unused_targets(names):
            logger.warning("quantization target %r matched no layer of the model", pattern)
    for (what, pattern), layers in partial_experts.items():
        logger.warning(
            "%s %r matches some of the routed experts' projections in %d MoE layers (%s, "
            "...), not all: those experts stay unquantized (one MoE layer's experts have one "
            "precision). To quantize them, target the layer ('*mlp.experts') or every "
            "projection, and keep `ignore` off them",
            what,
            pattern,
            len(layers),
            layers[0],
        )
    for (scheme, origin), kinds in chosen.items():
        listing = ", ".join(f"{kind}: {count}" for kind, count in sorted(kinds.items()))
        logger.info(
            "quantized %d layers as %s (from %s): %s", sum(kinds.values()), scheme, origin, listing
        )


def _swap(model: nn.Module, name: str, module: nn.Module, method, recreate: bool) -> None:
    """Give `module` the new method; `recreate` re-registers its checkpoint parameters in the
    method's format (a pre-quantized layer), else the full-precision weight stays for the
    method to quantize after loading."""
    if isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead):
        if recreate:
            raise ValueError(
                f"{name}: a quantized embedding table in the checkpoint is not supported"
            )
        if method.spec.scheme == "int8_w8a8":
            raise ValueError(
                f"{name}: an embedding lookup has no activations to quantize; target it with "
                "a weight-only scheme (int8, int4, fp8)"
            )
    if recreate:
        if isinstance(module, ParallelLMHead) and _is_tied(model, module):
            raise ValueError(
                f"{name}: a pre-quantized LM head tied to the embedding is not supported"
            )
        delattr(module, "weight")
        method.create_weights(
            module, module.input_size, module.output_size, module.weight_loader_ref()
        )
    module.quant_method = method


def _is_tied(model: nn.Module, head: nn.Module) -> bool:
    return any(
        m is not head and getattr(m, "weight", None) is head.weight
        for m in model.modules()
        if isinstance(m, VocabParallelEmbedding)
    )


def _kind(name: str) -> str:
    """`model.layers.3.self_attn.qkv_proj` -> `self_attn.qkv_proj`: the layer kind, for logs."""
    parts = name.split(".")
    return ".".join(p for p in parts[-2:] if not p.isdigit()) if len(parts) > 1 else name
