"""`WeightCacheKey`: everything that decides which tensors a model load produces.

The engine computes its key before loading and the daemon answers only an equal key;
a difference is named field by field, never silently accepted. The checkpoint is
fingerprinted by its safetensors headers (names, dtypes, shapes, offsets of every
tensor) and config.json, without reading tensor data: cheap, and it changes whenever
the files are re-saved, re-quantized or re-sharded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from minivllm.config import EngineConfig
    from minivllm.kernels.registry import Kernels

_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header
# The processed tensors' layouts, raised whenever a load step changes what it exports: a
# daemon and an engine of different layouts then differ in this field and the engine
# falls back to its own load. "1": through 2026-12-04; "2": a bf16 checkpoint's routed
# experts as bf16 panels [E, panels, K, 16] in fp32 engines on the AVX2 kernels; "3":
# int8_w8a8's and int4_w4a8's prepacked GEMM copies exported too (buffers `packed`,
# `w13_packed`, `w2_packed`), which mapping engines take instead of packing their own;
# "4": int4_w4a8 on its panels without its rows (`weight` [N, 0], packing.drop_rows);
# "5": int8_w8a8 on VNNI panels without its rows too.
WEIGHT_LAYOUT = "5"


@dataclass(frozen=True, slots=True)
class WeightCacheKey:
    checkpoint: str
    model_config: str
    architectures: str
    dtype: str
    max_model_len: int
    quantization: str
    quant_config_hash: str
    tp_size: int
    tp_rank: int
    device: str
    kernel_isa: str
    minivllm_version: str
    torch_version: str
    # the speculative draft the daemon also holds: "none", or a hash of the method and the
    # draft's checkpoint fingerprint, config.json and context length
    draft: str = "none"
    # WEIGHT_LAYOUT; a peer from before the field existed reads as "1"
    layout: str = "1"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> WeightCacheKey:
        """The key a peer sent; a missing, extra or mistyped field is a ValueError."""
        if not isinstance(data, dict):
            raise ValueError("cache key must be a JSON object")
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        # a peer from before a defaulted field existed: the default (e.g. draft "none"), so
        # the comparison can name the field instead of refusing the whole key
        data = {
            **{
                f.name: f.default
                for f in dataclasses.fields(cls)
                if f.default is not dataclasses.MISSING
            },
            **data,
        }
        if set(data) != set(fields):
            raise ValueError(f"cache key fields differ: expected {sorted(fields)}")
        for name, kind in fields.items():
            expected = int if kind == "int" else str
            if type(data[name]) is not expected:
                raise ValueError(f"cache key field {name!r} must be {expected.__name__}")
        return cls(**data)

    def mismatched_fields(self, other: WeightCacheKey) -> list[str]:
        return [
            f.name
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


def checkpoint_fingerprint(files: list[str]) -> str:
    """A hash of the sorted file basenames and each file's 8-byte length and JSON header."""
    digest = hashlib.sha256()
    for path in sorted(files, key=os.path.basename):
        digest.update(os.path.basename(path).encode() + b"\0")
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) != 8:
                raise ValueError(f"{path} is not a safetensors file (shorter than 8 bytes)")
            (size,) = struct.unpack("<Q", prefix)
            if size > _MAX_HEADER_BYTES:
                raise ValueError(f"{path}: safetensors header of {size} bytes is implausible")
            digest.update(prefix + f.read(size))
    return digest.hexdigest()


def _file_hash(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except FileNotFoundError:
        return "none"


def _quantization(model: Any) -> tuple[str, str]:
    """The checkpoint's quantization method (or "none") and the online one, by name, and a
    hash of both configurations (targets, schemes, groups: what the processed weights are)."""
    quant = getattr(model.hf_config, "quantization_config", None) or {}
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    online = model.quantization
    methods = [str(quant.get("quant_method", "unknown"))] if quant else []
    methods += [online.method] if online is not None and online.targets else []
    if not methods:
        return "none", "none"
    text = json.dumps(quant, sort_keys=True, default=str)
    text += online.to_json() if online is not None else ""
    return "+".join(methods), hashlib.sha256(text.encode()).hexdigest()


def _draft(config: EngineConfig) -> str:
    from minivllm.loader.safetensors_loader import checkpoint_files

    spec = config.speculative_config
    if spec is None or not spec.model:
        return "none"
    parts = {
        "method": spec.method,
        "checkpoint": checkpoint_fingerprint(checkpoint_files(spec.model)),
        "config": _file_hash(os.path.join(spec.model, "config.json")),
        "max_model_len": config.scheduler.max_model_len,
    }
    return (
        f"{spec.method}:" + hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
    )


def compute_key(config: EngineConfig, kernels: Kernels, tp_rank: int) -> WeightCacheKey:
    """This engine's key; computed before loading (post-load steps may change the config)."""
    import torch

    from minivllm import __version__
    from minivllm.loader.safetensors_loader import checkpoint_files

    model = config.model
    quantization, quant_hash = _quantization(model)
    return WeightCacheKey(
        checkpoint=checkpoint_fingerprint(checkpoint_files(model.model)),
        model_config=_file_hash(os.path.join(model.model, "config.json")),
        architectures=",".join(getattr(model.hf_config, "architectures", None) or []),
        dtype=str(model.dtype).removeprefix("torch."),
        max_model_len=model.max_model_len,
        quantization=quantization,
        quant_config_hash=quant_hash,
        tp_size=config.parallel.tensor_parallel_size,
        tp_rank=tp_rank,
        device=config.device,
        kernel_isa=kernels.name,
        minivllm_version=__version__,
        torch_version=torch.__version__,
        draft=_draft(config),
        layout=WEIGHT_LAYOUT,
    )
