"""Engine configuration: four frozen records, resolved once from user arguments."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# torch is imported where it is used, so that `minivllm --help` starts without it
logger = logging.getLogger("minivllm")

_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}
LOAD_FORMATS = ("auto", "ipc_cache")
# Keys HF configs use for the trained context length, in the order transformers reads them.
_MAX_LEN_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
)


@dataclass(frozen=True)
class ModelConfig:
    model: str
    tokenizer: str
    hf_config: Any
    dtype: torch.dtype
    max_model_len: int
    seed: int = 0
    trust_remote_code: bool = False
    eos_token_ids: frozenset[int] = frozenset()
    # online quantization and kernel choices (`quantization/config.py`), or None
    quantization: Any = None
    # the layers the checkpoint itself stores quantized (`quantization/compressed_tensors.py`)
    checkpoint_quantization: Any = None

    @property
    def architecture(self) -> str:
        return (getattr(self.hf_config, "architectures", None) or ["<none>"])[0]

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size


# vLLM's kv_cache_dtype values minivllm takes, and the torch dtype each stores ("auto": the
# model's). fp8 is stored unscaled (vLLM's k_scale = v_scale = 1.0 when a checkpoint carries
# none).
_KV_CACHE_TORCH_DTYPES = {
    "auto": None,
    "bfloat16": "bfloat16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
KV_CACHE_DTYPES = tuple(_KV_CACHE_TORCH_DTYPES)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    cache_dtype: str = "auto"  # KV_CACHE_DTYPES
    # fp8 caches: each layer's k/v scales from its first forward's keys and values
    calculate_kv_scales: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.cache_dtype!r}"
            )
        if self.calculate_kv_scales and not self.cache_dtype.startswith("fp8"):
            raise ValueError(
                "calculate_kv_scales scales an fp8 KV cache; pass kv_cache_dtype='fp8' "
                f"(got {self.cache_dtype!r})"
            )

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the paged KV cache stores under an engine computing in `model_dtype`."""
        import torch

        name = _KV_CACHE_TORCH_DTYPES[self.cache_dtype]
        if name is None:
            return model_dtype
        if name == "bfloat16" and model_dtype == torch.float16:
            raise ValueError(
                "kv_cache_dtype='bfloat16' under a float16 engine saves no memory and turns "
                "keys past float16's range into inf; use kv_cache_dtype='auto' or 'fp8'"
            )
        return getattr(torch, name)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # KV slots reserved past each decode's scheduled tokens, where a draft model writes
    # the keys of the drafts it proposes after the step (0 without one).
    num_lookahead_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: `tensor_parallel_size` ranks, spread evenly over `nnodes` hosts.

    `distributed_init_method` (`tcp://host:port` of node 0) is where the ranks meet;
    None means one node, on loopback, at a free port picked at start.
    """

    tensor_parallel_size: int = 1
    nnodes: int = 1
    distributed_init_method: str | None = None

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        if tp < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
        if self.nnodes < 1 or tp % self.nnodes:
            raise ValueError(
                f"nnodes={self.nnodes} must be >= 1 and divide tensor_parallel_size={tp} "
                "(every node runs the same number of ranks)"
            )
        method = self.distributed_init_method
        if method is not None and not re.fullmatch(r"tcp://\[?[\w.:-]+\]?:\d+", method):
            raise ValueError(f"distributed_init_method must be tcp://HOST:PORT, got {method!r}")
        if self.nnodes > 1 and method is None:
            raise ValueError(
                "nnodes > 1 needs the address of node 0: pass distributed_init_method="
                "'tcp://HOST:PORT' (--distributed-init-method) or set MASTER_ADDR and MASTER_PORT"
            )

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    def verify(self, hf_config: Any, device: str) -> None:
        """Refuse, with the reason, a TP size the model or this host cannot be split into."""
        tp = self.tensor_parallel_size
        if tp == 1:
            return
        text = getattr(hf_config, "text_config", None) or hf_config
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        if heads % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide the model's {heads} attention heads; "
                f"use one of {_divisors(heads)}"
            )
        if (kv_heads >= tp and kv_heads % tp) or (kv_heads < tp and tp % kv_heads):
            raise ValueError(
                f"tensor_parallel_size={tp} cannot split the model's {kv_heads} KV heads: it must "
                "divide them, or be a multiple of them (each KV head then lives on several ranks)"
            )
        if text.intermediate_size % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide the MLP's intermediate size "
                f"{text.intermediate_size}"
            )
        moe = getattr(text, "moe_intermediate_size", None)
        if moe and getattr(text, "n_routed_experts", None) and moe % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide the experts' intermediate size {moe}"
            )
        shard = -(-text.vocab_size // tp)
        if shard * (tp - 1) >= text.vocab_size:
            raise ValueError(
                f"tensor_parallel_size={tp} splits the {text.vocab_size}-token vocabulary into "
                f"slices of {shard}, leaving the last rank none; use fewer ranks"
            )
        local, limit, unit = self.ranks_per_node, *_host_limit(device)
        if local > limit:
            raise ValueError(
                f"tensor_parallel_size={tp} over nnodes={self.nnodes} puts {local} ranks on each "
                f"host, but this host has {limit} {unit}; each rank needs one of its own"
            )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: str = "cpu"
    # Run every step layer by layer in Python: no whole-step replay (today the one-call
    # fused decode step; CUDA graphs where they come). For debugging and comparisons.
    enforce_eager: bool = False
    # Use minivllm's compiled kernels where the device, dtype and CPU have them.
    cpu_kernels: bool = True
    # An attention backend by name (`layers/attention/registry.py`); None picks for the machine.
    attention_backend: str | None = None
    # Speculative decoding (`spec_decode/config.py`); None: off.
    speculative_config: Any = None
    # Watermarking of sampled tokens (`watermark/config.py`); None: off.
    watermark_config: Any = None
    # Where the weights come from: "auto" (the checkpoint) or "ipc_cache" (a weight-cache
    # daemon, `weight_cache/`, with its `WeightCacheClientConfig` here).
    load_format: str = "auto"
    weight_cache_config: Any = None
    # HiSparse's host KV tier under sparse attention (`hisparse/config.py`); None: off.
    hisparse_config: Any = None

    @property
    def decode_query_len(self) -> int:
        """Query tokens of a decode: 1, or 1 + the drafts a verification checks."""
        spec = self.speculative_config
        return 1 + spec.num_speculative_tokens if spec else 1

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.hisparse_config is not None and self.device != "cpu":
            # its copies and hot-buffer indexing assume one memory; a CUDA tier (pinned
            # host pool, H2D copies on a side stream) has not been built or tested
            raise ValueError(f"HiSparse runs on CPU engines only so far, not on {self.device!r}")
        self.parallel.verify(self.model.hf_config, self.device)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _host_limit(device: str) -> tuple[int, str]:
    """How many TP ranks one host can give a device of their own: GPUs, or CPU cores."""
    if device == "cuda":
        import torch

        return torch.cuda.device_count(), "CUDA devices"
    try:
        return len(os.sched_getaffinity(0)), "CPU cores available to this process"
    except AttributeError:  # not Linux
        return os.cpu_count() or 1, "CPU cores"


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch sees no CUDA device")
    return device


def resolve_dtype(dtype: str | torch.dtype, hf_config: Any, device: str) -> torch.dtype:
    import torch

    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        resolved = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(resolved, str):
            resolved = getattr(torch, _DTYPES.get(resolved, "float32"))
        resolved = resolved or torch.float32
        if resolved == torch.float16 and device == "cpu":
            logger.warning(
                "float16 checkpoint on CPU: running in bfloat16 instead (faster, same range as float32)"
            )
            resolved = torch.bfloat16
        if resolved == torch.bfloat16 and device == "cpu" and not _cpu_has_bf16():
            # Without AVX512-BF16 every bf16 matmul converts to fp32 on the fly and
            # minivllm's bf16 kernels are off. The fp32 engine runs the AVX2 kernels,
            # which keep the checkpoint's bf16 linear weights as bf16 (exact, half the
            # bytes) and compute in fp32 (`layers/panel_linear.py`). Measured on an
            # AVX2-capped Xeon, 8-layer Qwen3-0.6B shape, 32 x (128 in, 64 out): this
            # path 73 tok/s, the same engine in bf16 ~15 (docs/performance.md). An
            # explicit dtype="bfloat16" is still honoured.
            logger.warning(
                "this CPU has no AVX512-BF16: running the bfloat16 checkpoint in float32 "
                "(dtype='auto') on the AVX2 kernels, its linear weights still held as bf16; "
                "--dtype bfloat16 keeps bf16 activations too (slower here)"
            )
            resolved = torch.float32
    elif dtype in _DTYPES:
        resolved = getattr(torch, _DTYPES[dtype])
    else:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    if resolved not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {resolved}; use float32, bfloat16 or float16")
    return resolved


def _cpu_has_bf16() -> bool:
    from minivllm.kernels.isa import cpu_has_avx512_bf16

    return cpu_has_avx512_bf16()


def derive_max_model_len(hf_config: Any, requested: int | None) -> int:
    """The context length as transformers reads the config.

    A rope scaling factor never multiplies `max_position_embeddings` here: the
    checkpoint's `max_position_embeddings` already states the scaled length
    (vLLM v0.30 fixed exactly this double scaling for YaRN vendor aliases).
    """
    text_config = getattr(hf_config, "text_config", None) or hf_config
    lengths = [getattr(text_config, k) for k in _MAX_LEN_KEYS if getattr(text_config, k, None)]
    derived = min(lengths) if lengths else 2048
    if requested is None:
        return derived
    if requested < 1:
        raise ValueError(f"max_model_len must be >= 1, got {requested}")
    if requested > derived:
        raise ValueError(
            f"max_model_len={requested} is larger than the model's maximum of {derived} "
            f"(from its config.json); pass max_model_len <= {derived}"
        )
    return requested


def read_eos_token_ids(model_dir: str, hf_config: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (hf_config, _generation_config(model_dir)):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return frozenset(ids)


def _generation_config(model_dir: str) -> Any:
    if not os.path.exists(os.path.join(model_dir, "generation_config.json")):
        return None
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(model_dir)
