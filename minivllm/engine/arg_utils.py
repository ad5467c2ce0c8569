"""User-facing engine arguments (the `LLM(...)` keywords and `serve` flags), resolved into `EngineConfig`."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

from minivllm.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    derive_max_model_len,
    read_eos_token_ids,
    resolve_device,
    resolve_dtype,
)
from minivllm.hisparse.config import resolve_hisparse_config
from minivllm.loader.hub import resolve_model_path
from minivllm.quantization.compressed_tensors import read_checkpoint_quantization
from minivllm.quantization.config import resolve_quantization
from minivllm.quantization.kv_cache_scheme import resolve_kv_cache_dtype
from minivllm.spec_decode.config import SpeculativeConfig
from minivllm.watermark.config import WatermarkConfig

logger = logging.getLogger("minivllm")


@dataclass
class EngineArgs:
    model: str
    tokenizer: str | None = None
    # a Hub id's branch, tag or commit, and where its files are cached (default: HF_HOME)
    revision: str | None = None
    download_dir: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int | None = None  # 128 on CPU (as vLLM's CPU backend), 16 on CUDA
    kv_cache_memory_bytes: int | None = None
    # what the paged KV cache stores (config.KV_CACHE_DTYPES); "auto": the model's dtype
    kv_cache_dtype: str = "auto"
    # vLLM's calculate_kv_scales: an fp8 cache's scales from each layer's first keys/values
    calculate_kv_scales: bool = False
    enable_prefix_caching: bool = True
    trust_remote_code: bool = False
    device: str = "auto"
    tensor_parallel_size: int = 1
    nnodes: int = 1
    distributed_init_method: str | None = None
    enforce_eager: bool = False
    cpu_kernels: bool = True
    attention_backend: str | None = None
    # vLLM's speculative_config: a dict, or its JSON text (`--speculative-config`)
    speculative_config: dict[str, Any] | str | None = None
    # vLLM's watermark_config: a dict, or its JSON text (`--watermark-config`); it may hold
    # the key, so it stays out of repr
    watermark_config: dict[str, Any] | str | None = dataclasses.field(default=None, repr=False)
    # "auto" (the checkpoint) or "ipc_cache" (a weight-cache daemon; docs/fast-start.md),
    # whose options are model_loader_extra_config: a dict, or its JSON text
    load_format: str = "auto"
    model_loader_extra_config: dict[str, Any] | str | None = None
    # online quantization (docs/quantization.md): a shorthand or "online" with
    # quantization_config's targets; kernel_config's linear_backend_per_quant picks ops
    quantization: str | None = None
    quantization_config: dict[str, Any] | str | None = None
    kernel_config: dict[str, Any] | str | None = None
    # HiSparse (docs/sparse-attention.md): vLLM's kv_transfer_config naming the
    # HiSparseConnector, and attention_config's optional {"hisparse_config": {...}} tuning
    kv_transfer_config: dict[str, Any] | str | None = None
    attention_config: dict[str, Any] | str | None = None

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: object) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(
                f"unknown engine argument(s): {', '.join(unknown)}; "
                f"accepted: {', '.join(sorted(names - {'model'}))}"
            )
        return cls(model=model, **kwargs)  # type: ignore[arg-type]

    def create_engine_config(self) -> EngineConfig:
        from transformers import AutoConfig

        model_dir = resolve_model_path(self.model, self.revision, self.download_dir)
        hf_config = AutoConfig.from_pretrained(model_dir, trust_remote_code=self.trust_remote_code)
        from minivllm.models.registry import resolve_model_class

        resolve_model_class(getattr(hf_config, "architectures", None))  # fail early
        device = resolve_device(self.device)
        max_model_len = derive_max_model_len(hf_config, self.max_model_len)
        checkpoint_quantization = read_checkpoint_quantization(hf_config)
        model = ModelConfig(
            model=model_dir,
            tokenizer=resolve_model_path(self.tokenizer, None, self.download_dir, need_config=False)
            if self.tokenizer
            else model_dir,
            hf_config=hf_config,
            dtype=resolve_dtype(self.dtype, hf_config, device),
            max_model_len=max_model_len,
            seed=self.seed,
            trust_remote_code=self.trust_remote_code,
            eos_token_ids=read_eos_token_ids(model_dir, hf_config),
            quantization=resolve_quantization(
                self.quantization, self.quantization_config, self.kernel_config
            ),
            checkpoint_quantization=checkpoint_quantization,
        )
        kv_cache_dtype = resolve_kv_cache_dtype(
            self.kv_cache_dtype,
            checkpoint_quantization.kv_cache if checkpoint_quantization else None,
            hf_config,
            kernels_read_fp8=not bf16_cpu_kernels(device, model.dtype, self.cpu_kernels),
        )
        batched = self.max_num_batched_tokens or max(4096, min(max_model_len, 8192))
        block_size = self.block_size or default_block_size(device)
        speculative = SpeculativeConfig.from_value(self.speculative_config)
        if speculative is not None:
            speculative = resolve_draft_model(speculative, hf_config, self.trust_remote_code)
        watermark = WatermarkConfig.from_value(self.watermark_config)
        check_watermark_with_speculation(watermark, speculative)
        # a draft model writes the keys of its k proposals past each decode's tokens
        lookahead = speculative.num_speculative_tokens if speculative and speculative.model else 0
        return EngineConfig(
            model=model,
            cache=CacheConfig(
                block_size,
                self.kv_cache_memory_bytes,
                self.enable_prefix_caching,
                kv_cache_dtype,
                self.calculate_kv_scales,
            ),
            scheduler=SchedulerConfig(self.max_num_seqs, batched, max_model_len, lookahead),
            parallel=ParallelConfig(
                self.tensor_parallel_size,
                self.nnodes,
                resolve_init_method(self.distributed_init_method, self.nnodes),
            ),
            device=device,
            enforce_eager=self.enforce_eager,
            cpu_kernels=self.cpu_kernels,
            attention_backend=self.attention_backend,
            speculative_config=speculative,
            watermark_config=watermark,
            load_format=self.load_format,
            weight_cache_config=resolve_weight_cache_config(
                self.load_format, self.model_loader_extra_config
            ),
            hisparse_config=resolve_hisparse_config(
                self.kv_transfer_config, self.attention_config, hf_config
            ),
        )


def bf16_cpu_kernels(device: str, dtype: Any, enabled: bool) -> bool:
    """Whether the engine will run the bf16 CPU kernel family (AVX512-BF16), whose
    attention reads bf16 caches only."""
    import torch

    from minivllm.kernels.isa import cpu_has_avx512_bf16

    return enabled and device == "cpu" and dtype == torch.bfloat16 and cpu_has_avx512_bf16()


def resolve_weight_cache_config(load_format: str, extra: dict[str, Any] | str | None) -> Any:
    """The weight cache's options for load_format "ipc_cache" (validated: unknown keys are
    errors); with any other format there must be none."""
    if load_format != "ipc_cache":
        if extra:
            raise ValueError("model_loader_extra_config is only read with load_format 'ipc_cache'")
        return None
    from minivllm.weight_cache.client_config import WeightCacheClientConfig

    return WeightCacheClientConfig.from_value(extra)


def resolve_draft_model(
    config: SpeculativeConfig, target_hf_config: Any, trust_remote_code: bool
) -> SpeculativeConfig:
    """The draft's directory resolved (bundled names too) and its vocabulary checked
    against the target's, before either model loads."""
    if config.model is None:
        return config
    from transformers import AutoConfig

    try:
        path = resolve_model_path(config.model)
    except ValueError as e:
        raise ValueError(f"speculative_config.model: {e}") from None
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(
            f"speculative_config.model {config.model!r} is not a checkpoint directory "
            "(no config.json) nor a bundled model name"
        )
    draft = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if config.method == "eagle":
        if draft.hidden_size != target_hf_config.hidden_size:
            raise ValueError(
                f"speculative_config.model is an EAGLE head of hidden size {draft.hidden_size}, "
                f"the target's is {target_hf_config.hidden_size}: the head must be trained on "
                "this target's hidden states"
            )
        if getattr(draft, "num_hidden_layers", 1) != 1:
            raise ValueError(
                f"speculative_config.model has {draft.num_hidden_layers} layers; method 'eagle' "
                "needs an EAGLE-1 head (one layer). Use method 'draft_model' for a full model"
            )
    elif draft.vocab_size != target_hf_config.vocab_size:
        raise ValueError(
            f"speculative_config.model has a vocabulary of {draft.vocab_size} tokens, the "
            f"target {target_hf_config.vocab_size}: a draft model must share the target's tokenizer"
        )
    return dataclasses.replace(config, model=path)


def check_watermark_with_speculation(
    watermark: WatermarkConfig | None, speculative: SpeculativeConfig | None
) -> None:
    """Which watermark and speculative-decoding combinations can run, refused before any
    model loads (vLLM's rules; docs/watermarking.md)."""
    if watermark is None or speculative is None:
        return
    if watermark.algorithm == "gumbel" and not watermark.allow_target_only_watermarking:
        raise ValueError(
            "watermark_config.algorithm 'gumbel' cannot watermark speculative drafts without "
            "biasing verification: use 'dual_key_gumbel', or set "
            "watermark_config.allow_target_only_watermarking to watermark only the recovery "
            "and bonus tokens"
        )
    if watermark.algorithm == "dual_key_gumbel":
        if speculative.method not in ("draft_model", "eagle"):
            raise ValueError(
                f"watermark_config.algorithm 'dual_key_gumbel' needs a model-based draft method "
                f"(draft_model or eagle) with a draft distribution, not {speculative.method!r}"
            )
        if speculative.draft_sample_method != "probabilistic":
            raise ValueError(
                "watermark_config.algorithm 'dual_key_gumbel' with speculative decoding needs "
                "speculative_config.draft_sample_method 'probabilistic'"
            )
        if speculative.rejection_sample_method != "standard":
            raise ValueError(
                "watermark_config.algorithm 'dual_key_gumbel' with speculative decoding needs "
                "speculative_config.rejection_sample_method 'standard'"
            )


def resolve_init_method(init_method: str | None, nnodes: int) -> str | None:
    """The explicit `tcp://host:port`; with several nodes, else torch's MASTER_ADDR/MASTER_PORT."""
    if init_method is not None or nnodes == 1:
        return init_method
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return f"tcp://{addr}:{port}" if addr and port else None


def default_block_size(device: str) -> int:
    """Tokens per KV block. On CPU, as in vLLM's CPU backend, 128: a request's decode
    blocks are then few and long, and decode attention reads them at ~19 GB/s where
    scattered 16-token blocks (4 KB per head) read at ~14 GB/s on this project's VM
    (64 x (256 in, 128 out) offline: 78 s against 81 s). Prefix caching then
    shares whole 128-token blocks."""
    return 128 if device == "cpu" else 16
