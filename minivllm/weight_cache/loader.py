"""`load_format="ipc_cache"`: the model's tensors mapped from a weight-cache daemon.

    key = compute_key(...)            before anything loads
    reply, fds = get_state(key)        manifest + the memfd (or: mismatch, unavailable)
    model = model_cls(...)             torch.empty: no pages touched, no init
    install mapped tensors             params and buffers become views of the memfd
    post-load, "already processed"     linear methods rebuild kernel objects only

Unavailable daemon, key mismatch or any failure while building fall back to the disk
load with a warning (or raise with `fallback=false`); an unsupported setup (device,
a linear method that cannot take processed weights) or an unsafe socket directory
raises either way. With tensor parallelism each rank maps its own shard from its
rank's socket (`..._tp<rank>.sock`, its own key's `tp_rank`) and watches its own
daemon rank; the ranks then agree: if any rank fell back to disk, all do. A speculative
draft the daemon holds too (its names under `DRAFT_PREFIX`) is mapped from the same
arena by `map_draft_model` when the drafter is built.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from minivllm.distributed.parallel_state import all_reduce_min, get_tp_rank
from minivllm.weight_cache.arena import (
    DRAFT_PREFIX,
    TensorEntry,
    entry_tensor,
    map_segments,
    named_tensors,
)
from minivllm.weight_cache.client import WeightCacheClient
from minivllm.weight_cache.client_config import WeightCacheClientConfig
from minivllm.weight_cache.key import compute_key
from minivllm.weight_cache.socket_dir import ensure_socket_dir, socket_path
from minivllm.weight_cache.watchdog import DaemonWatch

if TYPE_CHECKING:
    from minivllm.config import EngineConfig, ModelConfig
    from minivllm.kernels.registry import Kernels

logger = logging.getLogger("minivllm")


class UnsupportedForWeightCacheError(ValueError):
    """This engine's setup cannot take weights from the cache: a configuration error,
    raised even with `fallback`."""


def load_from_weight_cache(
    config: EngineConfig, kernels: Kernels, available_bytes: int | None
) -> nn.Module:
    from minivllm.loader.model_loader import load_model

    options: WeightCacheClientConfig = config.weight_cache_config or WeightCacheClientConfig()
    model = _empty_model(config.model, config.device)
    check_supported(config, options, model)
    tp_rank = get_tp_rank()
    path = options.socket_path or socket_path(
        ensure_socket_dir(options.socket_dir), tp_rank=tp_rank
    )
    client = WeightCacheClient(path, options.connect_timeout_s, options.state_timeout_s)
    mapped: nn.Module | None = None
    try:
        if not options.fallback:
            client.wait_until_up(options.state_timeout_s)
        mapped = _map_model(model, config, client, options, kernels, available_bytes, tp_rank)
    except Exception as e:
        if not options.fallback:
            raise
        logger.warning("Weight cache unusable (%s); falling back to disk loading", e)
    # the ranks agree (a no-op without TP): one rank on disk puts every rank on disk
    if all_reduce_min(int(mapped is not None)) == 1:
        return mapped
    if mapped is not None:
        logger.warning(
            "rank %d mapped its weights but another rank could not; loading from disk too, "
            "so that all ranks agree",
            tp_rank,
        )
    del mapped
    return load_model(config.model, config.device, kernels, available_bytes)


def check_supported(
    config: EngineConfig, options: WeightCacheClientConfig, model: nn.Module
) -> None:
    if config.device != "cpu":
        raise UnsupportedForWeightCacheError(
            f"load_format 'ipc_cache' maps CPU shared memory; device {config.device!r} "
            "is not supported yet"
        )
    if config.parallel.tensor_parallel_size > 1 and options.socket_path is not None:
        raise UnsupportedForWeightCacheError(
            "model_loader_extra_config.socket_path names one socket; with "
            "tensor_parallel_size > 1 each rank has its own: give socket_dir instead"
        )
    from minivllm.layers.linear_method import LinearMethodBase

    methods = {
        type(m.quant_method).__name__
        for m in model.modules()
        if isinstance(getattr(m, "quant_method", None), LinearMethodBase)
        and not m.quant_method.supports_mapped_weights
    }
    if methods:
        raise UnsupportedForWeightCacheError(
            f"linear method(s) {sorted(methods)} cannot take already-processed weights "
            "from the weight cache"
        )


def _empty_model(
    config: ModelConfig, device: str, model_cls: type[nn.Module] | None = None
) -> nn.Module:
    """The model with uninitialised (`torch.empty`) parameters whose pages are never touched,
    so they cost no memory before the mapped tensors replace them. Not the meta device: its
    first use in a process imports torch's meta decompositions, 1.8 s measured here."""
    from minivllm.loader.model_loader import default_dtype, quantize_layers
    from minivllm.models.registry import resolve_model_class

    if model_cls is None:
        model_cls = resolve_model_class(getattr(config.hf_config, "architectures", None))
    with torch.device(device), default_dtype(config.dtype):
        model = model_cls(config.hf_config, config.max_model_len)
        quantize_layers(model, config)
        # quantized layers take the shapes of their processed tensors, which are mapped
        for module in model.modules():
            prepare = getattr(getattr(module, "quant_method", None), "prepare_for_mapping", None)
            if prepare is not None:
                prepare(module)
    return model


def _map_model(
    model: nn.Module,
    config: EngineConfig,
    client: WeightCacheClient,
    options: WeightCacheClientConfig,
    kernels: Kernels,
    available_bytes: int | None,
    tp_rank: int,
) -> nn.Module:
    from minivllm.loader.model_loader import process_weights_after_loading

    start = time.perf_counter()
    key = compute_key(config, kernels, tp_rank=tp_rank)
    reply, fds = client.get_state(key)
    copy = options.mode == "copy"
    try:
        segments = map_segments(fds, _int_list(reply.get("segment_bytes")), copy)
        fds = []
        num = install_tensors(model, reply, segments)
    finally:
        for fd in fds:
            os.close(fd)
        if copy:  # our copy is made (or failed): the daemon frees its memory either way
            client.release()
    # zero_copy: no oneDNN-prepacked copies. They are opaque engine-owned duplicates of
    # the weights (the one copy the daemon shares would become two) and cost a reorder
    # of every weight at each start (0.44 s of 0.50 s for the 0.6B shape here); batches
    # over 64 rows then run stock F.linear on the plain weights (~10% slower GEMMs).
    budget = available_bytes if copy else None
    process_weights_after_loading(model, kernels, budget, mapped=True)
    if any(str(e.get("name", "")).startswith(DRAFT_PREFIX) for e in reply.get("entries") or []):
        model.weight_cache_arena = (reply, segments)  # the draft's part, for map_draft_model
    if not copy:
        DaemonWatch(int(reply["pid"]), int(reply["start_time"]), client.path).attach(model)
    logger.info(
        "Mapped %d tensors from the weight cache daemon (%s mode) in %.3f s",
        num,
        options.mode,
        time.perf_counter() - start,
    )
    return model.eval()


def map_draft_model(
    target: nn.Module,
    engine: EngineConfig,
    config: ModelConfig,
    kernels: Kernels,
    model_cls: type[nn.Module] | None,
) -> nn.Module | None:
    """The speculative draft, its tensors mapped from the arena `target` was mapped from;
    None where the target was not mapped (it loaded from disk) or its daemon holds no
    draft: the draft then loads from disk too. (The cache key's `draft` field already
    matched: a daemon holding another draft made the target fall back.)"""
    from minivllm.loader.model_loader import process_weights_after_loading

    arena = getattr(target, "weight_cache_arena", None)
    if arena is None:
        return None
    options: WeightCacheClientConfig = engine.weight_cache_config or WeightCacheClientConfig()
    start = time.perf_counter()
    try:
        model = _empty_model(config, engine.device, model_cls)
        num = install_tensors(model, *arena, draft=True)
        process_weights_after_loading(model, kernels, None, mapped=True)
    except Exception as e:
        if not options.fallback:
            raise
        logger.warning("Weight cache unusable for the draft (%s); loading it from disk", e)
        return None
    logger.info(
        "Mapped %d draft model tensors from the weight cache daemon in %.3f s",
        num,
        time.perf_counter() - start,
    )
    return model.eval()


def install_tensors(
    model: nn.Module, reply: dict[str, Any], segments: list[torch.Tensor], draft: bool = False
) -> int:
    """Replace every parameter and buffer by its mapped tensor; names must match exactly.
    `draft`: the manifest's speculative-draft part (names under `DRAFT_PREFIX`), else the rest."""
    entries = [TensorEntry.from_json(e) for e in reply.get("entries") or []]
    aliases = reply.get("aliases") or {}
    if not isinstance(aliases, dict):
        raise ValueError("manifest aliases must be an object")

    def strip(name: str) -> str:
        return name.removeprefix(DRAFT_PREFIX) if draft else name

    def ours(name: str) -> bool:
        return name.startswith(DRAFT_PREFIX) == draft

    entries = [dataclasses.replace(e, name=strip(e.name)) for e in entries if ours(e.name)]
    aliases = {strip(k): strip(v) for k, v in aliases.items() if ours(str(k)) and ours(str(v))}
    modules = dict(model.named_modules(remove_duplicate=False))
    given = {e.name for e in entries} | set(aliases)
    _add_optional_buffers(modules, given)
    expected = {name for name, _, _ in named_tensors(model)}
    if given != expected:
        missing, extra = sorted(expected - given), sorted(given - expected)
        raise ValueError(
            f"manifest does not match the model: missing {missing[:5]}, extra {extra[:5]}"
        )
    installed: dict[str, torch.Tensor] = {}
    for entry in entries:
        tensor = entry_tensor(entry, segments)
        if entry.kind == "param":
            tensor = nn.Parameter(tensor, requires_grad=False)
        installed[entry.name] = tensor
        _set(modules, entry.name, tensor, entry.kind)
    for name, target in aliases.items():
        if target not in installed:
            raise ValueError(f"alias {name!r} names {target!r}, which is not in the manifest")
        kind = "param" if isinstance(installed[target], nn.Parameter) else "buffer"
        _set(modules, name, installed[target], kind)
    mapped_ids = {id(t) for t in installed.values()}
    left = [name for name, _, t in named_tensors(model) if id(t) not in mapped_ids]
    if left:
        raise ValueError(f"tensors left unmapped: {left[:5]}")
    return len(entries)


def _add_optional_buffers(modules: dict[str, nn.Module], names: set[str]) -> None:
    """Placeholders for the manifest's buffers that the model lacks but whose module's
    quant method takes from the cache (`optional_mapped_buffers`: the prepacked GEMM copies
    the daemon's load made; this engine may make none, as with another backend, and then
    drops them)."""
    for name in names:
        owner, _, attr = name.rpartition(".")
        module = modules.get(owner)
        method = getattr(module, "quant_method", None)
        if attr in getattr(method, "optional_mapped_buffers", ()) and attr not in module._buffers:
            module.register_buffer(attr, torch.empty(0), persistent=False)


def _set(modules: dict[str, nn.Module], name: str, tensor: torch.Tensor, kind: str) -> None:
    owner, _, attr = name.rpartition(".")
    module = modules[owner]
    table = module._parameters if kind == "param" else module._buffers
    if attr not in table:
        raise ValueError(f"manifest {kind} {name!r} is not a {kind} of the model")
    table[attr] = tensor


def _int_list(value: Any) -> list[int]:
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise ValueError("manifest segment_bytes must be a list of sizes")
    return value
