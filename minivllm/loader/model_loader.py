"""Build a model from its config, fill it from the checkpoint, and prepare it for inference."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from minivllm.config import EngineConfig, ModelConfig
from minivllm.kernels.registry import TORCH, Kernels
from minivllm.layers.cpu_linear import MAX_KERNEL_ROWS_PACKED, fits_prepacked
from minivllm.layers.custom_op import CustomOp
from minivllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.linear import LinearBase
from minivllm.layers.linear_method import UnquantizedLinearMethod
from minivllm.layers.moe import FusedMoE
from minivllm.loader.safetensors_loader import iterate_weights
from minivllm.loader.streamed_quantization import StreamedQuantization
from minivllm.models.registry import resolve_model_class
from minivllm.quantization.method import log_backends
from minivllm.utils import huge_pages
from minivllm.utils.memory import release_freed_host_memory

logger = logging.getLogger("minivllm")


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(
    config: ModelConfig,
    device: str,
    kernels: Kernels = TORCH,
    available_bytes: int | None = None,
    model_cls: type[nn.Module] | None = None,
) -> nn.Module:
    """The model on `device`, its weights loaded and processed for `kernels`.

    `model_cls` overrides the class the config's `architectures` name (an EAGLE head
    is a Llama/Qwen3 config that only the speculative decoder builds as a head).

    `available_bytes` is the memory this rank may still use; where given, the
    linears may keep prepacked copies of their weights if those fit in an eighth of it.
    """
    if model_cls is None:
        model_cls = resolve_model_class(getattr(config.hf_config, "architectures", None))
    with torch.device(device), default_dtype(config.dtype):
        model = model_cls(config.hf_config, config.max_model_len)
        quantize_layers(model, config)
    streamed = StreamedQuantization(model, kernels)
    try:
        model.load_weights(iterate_weights(config.model))
    finally:
        streamed.finish()
    process_weights_after_loading(model, kernels, available_bytes, arena_mark=streamed.arena_mark)
    return model.eval()


def quantize_layers(model: nn.Module, config: ModelConfig) -> None:
    """Give the layers that the checkpoint stores quantized, or that online quantization
    targets, their quantized method (`quantization/`); the rest stay as built. A checkpoint
    with fp8 KV-cache scales gives each attention layer `k_scale` and `v_scale`."""
    checkpoint = config.checkpoint_quantization
    if config.quantization is None and checkpoint is None:
        return
    from minivllm.quantization.apply import assign_quant_methods

    assign_quant_methods(model, config.quantization, checkpoint)
    if checkpoint is not None and checkpoint.kv_cache is not None:
        from minivllm.quantization.kv_cache import add_kv_scale_parameters

        add_kv_scale_parameters(model, checkpoint.kv_cache, config.hf_config)


def get_model(config: EngineConfig, kernels: Kernels, available_bytes: int | None) -> nn.Module:
    """The engine's model, from the checkpoint or (`load_format="ipc_cache"`) mapped from a
    weight-cache daemon (`weight_cache/`)."""
    if config.load_format == "ipc_cache":
        from minivllm.weight_cache.loader import load_from_weight_cache

        return load_from_weight_cache(config, kernels, available_bytes)
    return load_model(config.model, config.device, kernels, available_bytes)


def process_weights_after_loading(
    model: nn.Module,
    kernels: Kernels,
    available_bytes: int | None = None,
    mapped: bool = False,
    arena_mark: tuple[int, float] | None = None,
) -> None:
    """Once the checkpoint is in: each linear method processes its weights (repacking,
    quantizing) for the engine's kernels, and each custom op picks its compiled ops.

    `mapped`: the weights came already processed and read-only from the weight cache;
    linear methods rebuild only their kernel objects (`process_weights_after_mapping`).
    Layers `StreamedQuantization` processed while the checkpoint loaded are left as they
    are (their methods return at once); `arena_mark` is the huge-page arena's (bytes,
    seconds) before those, for the log."""
    linears = [
        m
        for m in model.modules()
        if isinstance(m, (LinearBase, ParallelLMHead))
        or (
            isinstance(m, VocabParallelEmbedding)
            and type(m.quant_method) is not UnquantizedLinearMethod
        )
    ]
    # oneDNN-prepacked copies serve the bf16 family's large batches only
    if kernels.op("gemv_bf16") is not None and available_bytes is not None:
        plain = [m for m in linears if type(m.quant_method) is UnquantizedLinearMethod]
        weight_bytes = sum(m.weight.nbytes for m in plain)
        if fits_prepacked(weight_bytes, available_bytes):
            kernels = dataclasses.replace(kernels, prepack_weights=True)
            logger.info(
                "oneDNN-prepacked copies of the linear and LM-head weights for batches over "
                "%d rows (+%.2f GiB)",
                MAX_KERNEL_ROWS_PACKED,
                weight_bytes / 2**30,
            )
    if not mapped:
        # what the streamed layers' processing freed goes back before the end's copies (a
        # tied LM head's prepacked or quantized one) are made on top of it
        release_freed_host_memory()
    tables = [m for m in model.modules() if type(m) is VocabParallelEmbedding]
    tied = {id(m): t for m in linears for t in tables if getattr(m, "weight", None) is t.weight}
    arena = huge_pages.weights_arena()
    placed, seconds = arena_mark or (arena.bytes_placed, arena.seconds)
    for module in linears:
        if mapped:
            module.quant_method.process_weights_after_mapping(module, kernels)
        else:
            module.quant_method.process_weights_after_loading(module, kernels)
        table = tied.get(id(module))
        if table is not None and module.weight.dim() == 3 and table.weight is not module.weight:
            # the LM head now holds the tied table as bf16 panels: the embedding reads
            # its rows from them (`panel_rows`) rather than keep the fp32 table too
            table.weight = module.weight
    # routed experts: quantized ones (quantization/moe_method.py) by their method,
    # unquantized ones as bf16 panels where an fp32 engine on AVX2 can hold them so
    moe_layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    plain_experts = [m for m in moe_layers if m.quant_method is None]
    for module in plain_experts:
        module.process_weights_after_loading(kernels)
    paneled = [m for m in plain_experts if m.panels_op is not None]
    if paneled:
        logger.info(
            "routed experts of %d MoE layers as bf16 panels (%.2f GiB) on the AVX2 kernels",
            len(paneled),
            sum(m.w13.nbytes + m.w2.nbytes for m in paneled) / 2**30,
        )
    experts = [m for m in moe_layers if m.quant_method is not None]
    for module in experts:
        if mapped:
            module.quant_method.process_weights_after_mapping(module, kernels)
        else:
            module.quant_method.process_weights_after_loading(module, kernels)
    log_backends(linears + experts)
    if arena.bytes_placed > placed:
        logger.info(
            "quantized weights on huge pages: %.2f GiB (%.2f s; MINIVLLM_HUGE_PAGES=0 skips)",
            (arena.bytes_placed - placed) / 2**30,
            arena.seconds - seconds,
        )
    for module in model.modules():
        if isinstance(module, CustomOp):
            module.select_kernels(kernels)
    if not mapped:
        # what processing freed (checkpoint weights quantized, copies moved to huge pages)
        # goes back to the kernel now, before the KV cache is sized from available memory
        release_freed_host_memory()
