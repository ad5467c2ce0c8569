"""Strict weight loading: every checkpoint tensor lands in exactly one parameter."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from minivllm.quantization.kv_cache_scheme import checkpoint_target

# Buffers some older checkpoints carry; they are recomputed, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_weights_strict(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed_modules: dict[str, tuple[str, object]],
    skip: tuple[str, ...] = (),
) -> None:
    """Load `(name, tensor)` pairs; unknown names and unfilled parameters are errors naming them.

    `packed_modules` maps a checkpoint module name (`q_proj`) to the merged
    parameter that holds it and its shard id (`("qkv_proj", "q")`).
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = _expected_sources(params, packed_modules, skip)
    loaded: set[str] = set()
    for name, tensor in weights:
        if name in skip or name.endswith(_IGNORED_SUFFIXES):
            continue
        target, shard_id = _map_name(name, packed_modules)
        kv_target = checkpoint_target(name) if target not in params else None
        if kv_target is not None and getattr(model, "unused_kv_cache_scales", False):
            continue  # a KV-cache scheme over a latent (MLA) cache: its scales go unused
        if kv_target == "" and any(".k_scale" in p for p in params):
            continue  # q_scale, prob_scale beside a KV-cache scheme: not used
        if kv_target:
            target = kv_target
        param = params.get(target)
        if param is None:
            raise ValueError(
                f"unexpected weight {name!r} in the checkpoint: the model has no such parameter"
            )
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            _copy(param, tensor, name)
        elif getattr(param, "raw_checkpoint_tensor", False):  # its loader unpacks or checks it
            try:
                loader(param, tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
        else:
            loader(param, tensor.to(param.dtype), shard_id)
        loaded.add(name)
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        )
        raise ValueError(f"the checkpoint is missing weights: {shown}")


def _map_name(name: str, packed_modules: dict[str, tuple[str, object]]) -> tuple[str, object]:
    for source, (target, shard_id) in packed_modules.items():
        if f".{source}." in name:
            return name.replace(f".{source}.", f".{target}."), shard_id
    return name, None


def _expected_sources(
    params: dict[str, nn.Parameter],
    packed_modules: dict[str, tuple[str, object]],
    skip: tuple[str, ...],
) -> set[str]:
    """The checkpoint names that must appear, derived from our parameter names."""
    expected = set()
    for name, param in params.items():
        if name in skip or getattr(param, "optional_checkpoint_tensor", False):
            continue
        sources = [s for s, (t, _) in packed_modules.items() if f".{t}." in name]
        if sources:
            expected.update(name.replace(f".{packed_modules[s][0]}.", f".{s}.") for s in sources)
        else:
            expected.add(name)
    return expected


def _copy(param: nn.Parameter, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(
            f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
        )
    param.data.copy_(tensor)
