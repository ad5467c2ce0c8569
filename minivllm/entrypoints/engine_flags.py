"""The engine's command-line flags, shared by `minivllm serve`, `minivllm worker` and the
weight-cache daemon: each flag's `dest` is an `EngineArgs` field, and its default is that
field's, so the CLI and the Python API cannot drift apart."""

from __future__ import annotations

import argparse
import dataclasses
import re

from minivllm.config import KV_CACHE_DTYPES
from minivllm.engine.arg_utils import EngineArgs
from minivllm.quantization.config import QUANTIZATION_METHODS

_ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def byte_size(text: str) -> int:
    """`4096`, `8M`, `8MiB`, `1.5G`: K/M/G/T are powers of 1024 (as for vLLM's memory flags)."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (try 8388608, 8M or 8MiB)")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** " kmgt".index(unit or " "))


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags whose `dest` is an `EngineArgs` field; defaults come from `EngineArgs` itself."""
    d = _ENGINE_DEFAULTS
    model = parser.add_argument_group("model")
    model.add_argument(
        "--tokenizer",
        default=d["tokenizer"],
        help="tokenizer directory or Hub id (default: the model's)",
    )
    model.add_argument(
        "--revision",
        default=d["revision"],
        help="for a Hub id: the branch, tag or commit to load (default: main)",
    )
    model.add_argument(
        "--download-dir",
        default=d["download_dir"],
        help="for a Hub id: where to cache its files (default: huggingface_hub's cache, "
        "under HF_HOME); HF_HUB_OFFLINE=1 uses only what is cached",
    )
    model.add_argument(
        "--dtype",
        default=d["dtype"],
        choices=["auto", "float32", "float", "bfloat16", "float16", "half"],
        help="weight and activation dtype; auto = the checkpoint's (float16 runs as bfloat16 on CPU)",
    )
    model.add_argument(
        "--seed", type=int, default=d["seed"], help="engine random seed (default: %(default)s)"
    )
    model.add_argument(
        "--max-model-len",
        metavar="TOKENS",
        type=_positive_int,
        default=d["max_model_len"],
        help="context length, prompt plus output (default: the model's)",
    )
    model.add_argument(
        "--trust-remote-code", action="store_true", help="allow custom code from the checkpoint"
    )
    model.add_argument(
        "--device",
        default=d["device"],
        choices=["auto", "cpu", "cuda"],
        help="default: %(default)s",
    )
    model.add_argument(
        "--quantization",
        "-q",
        default=d["quantization"],
        choices=QUANTIZATION_METHODS,
        help="quantize the linear layers at load (int8/int4/fp8: weight-only, all but the LM "
        "head); online: only the layers --quantization-config targets (docs/quantization.md)",
    )
    model.add_argument(
        "--quantization-config",
        metavar="JSON",
        default=d["quantization_config"],
        help='with online: e.g. \'{"targets": {"*mlp*": "int4_w4a16", "*self_attn*": '
        '"int8_w8a8"}, "ignore": ["re:.*layers\\.0\\..*"]}\'',
    )
    model.add_argument(
        "--kernel-config",
        metavar="JSON",
        default=d["kernel_config"],
        help='op per quantization scheme: e.g. \'{"linear_backend_per_quant": '
        '{"int4_w4a16": "torch"}}\' (cpu_kernel or torch; default: the fastest for the CPU)',
    )

    cache = parser.add_argument_group("KV cache")
    cache.add_argument(
        "--block-size",
        metavar="TOKENS",
        type=_positive_int,
        default=d["block_size"],
        help="tokens per KV block, a power of two (default: 128 on CPU, 16 on CUDA)",
    )
    cache.add_argument(
        "--kv-cache-memory-bytes",
        metavar="BYTES",
        type=byte_size,
        default=d["kv_cache_memory_bytes"],
        help="KV cache size, e.g. 8MiB or 4G (default: a share of free memory)",
    )
    cache.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=d["kv_cache_dtype"],
        help="what the KV cache stores: auto (the model's dtype, or fp8 with the checkpoint's "
        "scales where a compressed-tensors checkpoint declares a kv_cache_scheme), bfloat16 "
        "(half an fp32 engine's cache), fp8 / fp8_e4m3 or fp8_e5m2 (a quarter of an fp32 "
        "engine's cache, half a bf16 one's; scaled by the checkpoint's k/v scales, else "
        "unscaled) (default: %(default)s)",
    )
    cache.add_argument(
        "--calculate-kv-scales",
        action="store_true",
        default=d["calculate_kv_scales"],
        help="with an fp8 KV cache: scale each layer's keys and values by their largest "
        "magnitude in the first batch (keys / 200, values / 100, as vLLM), instead of the "
        "checkpoint's scales or none",
    )
    cache.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d["enable_prefix_caching"],
        help="reuse KV blocks of shared prompt prefixes (default: on)",
    )

    sched = parser.add_argument_group("scheduler")
    sched.add_argument(
        "--max-num-seqs",
        metavar="N",
        type=_positive_int,
        default=d["max_num_seqs"],
        help="most sequences in one batch (default: %(default)s)",
    )
    sched.add_argument(
        "--max-num-batched-tokens",
        metavar="TOKENS",
        type=_positive_int,
        default=d["max_num_batched_tokens"],
        help="token budget of one step (default: max(4096, min(max_model_len, 8192)))",
    )

    run = parser.add_argument_group("parallelism and execution")
    run.add_argument(
        "--tensor-parallel-size",
        "-tp",
        metavar="N",
        type=_positive_int,
        default=d["tensor_parallel_size"],
        help="GPUs to shard the model over (default: %(default)s)",
    )
    run.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=d["enforce_eager"],
        help="run every step layer by layer, without the one-call fused decode step "
        "(and, on CUDA, graph capture) (default: off)",
    )
    run.add_argument(
        "--cpu-kernels",
        action=argparse.BooleanOptionalAction,
        default=d["cpu_kernels"],
        help="bf16 on CPU: use minivllm's fused CPU kernels where they apply (default: on)",
    )
    run.add_argument(
        "--speculative-config",
        metavar="JSON",
        default=d["speculative_config"],
        help="speculative decoding, as vLLM's: e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\', '
        '\'{"method": "draft_model", "model": "demo-draft", "num_speculative_tokens": 3}\' or '
        '\'{"method": "eagle", "model": "demo-eagle", "num_speculative_tokens": 3}\' '
        "(methods: ngram, draft_model, eagle; docs/speculative-decoding.md)",
    )
    run.add_argument(
        "--watermark-config",
        metavar="JSON",
        default=d["watermark_config"],
        help="watermark every sampled output, as vLLM's: e.g. "
        '\'{"algorithm": "gumbel", "key_env": "WM_KEY"}\'; give the key by key_env or '
        "key_file rather than key, so it stays out of process lists (docs/watermarking.md)",
    )
    run.add_argument(
        "--kv-transfer-config",
        metavar="JSON",
        default=d["kv_transfer_config"],
        help="HiSparse's host KV tier (sparse models), as vLLM's: '{\"kv_connector\": "
        '"HiSparseConnector", "kv_role": "kv_both", "kv_connector_extra_config": '
        '{"host_pool_gib": 8}}\' (docs/sparse-attention.md)',
    )
    run.add_argument(
        "--attention-config",
        metavar="JSON",
        default=d["attention_config"],
        help='\'{"hisparse_config": {"device_buffer_size": N, "eager_host_mirror": B}}\'',
    )
    run.add_argument(
        "--attention-backend",
        metavar="NAME",
        default=d["attention_backend"],
        help="attention backend: torch (plain PyTorch, any device) or cpu (bf16 CPU kernels) "
        "for full K/V; sparse_mla for DeepSeek's latent caches (default: chosen for the "
        "model and the machine)",
    )
    run.add_argument(
        "--load-format",
        choices=["auto", "ipc_cache"],
        default=d["load_format"],
        help="auto: read the checkpoint; ipc_cache: map the weights a `minivllm "
        "weight-cache-daemon` holds (docs/fast-start.md) (default: %(default)s)",
    )
    run.add_argument(
        "--model-loader-extra-config",
        metavar="JSON",
        default=d["model_loader_extra_config"],
        help='for ipc_cache: e.g. \'{"mode": "zero_copy", "fallback": true, "socket_dir": DIR}\'',
    )


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    return EngineArgs(
        **{name: getattr(args, name) for name in _ENGINE_DEFAULTS if hasattr(args, name)}
    )
