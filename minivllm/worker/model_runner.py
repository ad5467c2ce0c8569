"""The model runner: SchedulerOutput in, sampled tokens out. It never calls back."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from minivllm.config import EngineConfig
from minivllm.distributed.parallel_state import tp_broadcast
from minivllm.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from minivllm.kernels.isa import cpu_model, isa_summary
from minivllm.kernels.registry import select_kernels
from minivllm.layers.attention import AttentionLayerBase, FullAttentionSpec, KVCacheSpec
from minivllm.layers.attention.backend import build_common_metadata
from minivllm.layers.attention.registry import select_attention_backend
from minivllm.layers.forward_context import ForwardContext, forward_context
from minivllm.layers.fused_decode import Avx2FusedDecode, FusedLlamaDecode
from minivllm.layers.sampler import Sampler
from minivllm.loader.model_loader import get_model
from minivllm.quantization.kv_cache import suspended_kv_calibration, use_kv_scales
from minivllm.spec_decode.draft_model import DraftModelProposer
from minivllm.spec_decode.eagle import EagleProposer
from minivllm.spec_decode.ngram import NgramProposer
from minivllm.spec_decode.profiling import profile_step_cost
from minivllm.spec_decode.proposer import Proposer, TargetHiddenStates
from minivllm.spec_decode.spec_decoder import SpecDecoder
from minivllm.structured_output.manager import StructuredOutputManager
from minivllm.utils.memory import (
    available_host_bytes,
    default_kv_cache_bytes,
    keep_freed_host_memory,
)
from minivllm.watermark.generation import Watermarker
from minivllm.worker.input_batch import InputBatch
from minivllm.worker.request_state import CachedRequestState

logger = logging.getLogger("minivllm")


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: Any  # the attention backend's metadata for this step
    sample_req_ids: list[str]  # requests whose last scheduled token yields a new token
    # per sampling request, the draft tokens it verifies this step (empty: none)
    spec_drafts: list[list[int]]
    # hidden rows to project: each sampling request's rows (its drafts' and the last
    # token's), then prompt-logprob rows
    logits_indices: list[int]
    # req_id -> (first row in logits_indices, target prompt token ids)
    prompt_logprob_rows: dict[str, tuple[int, list[int]]]
    # per scheduled request: (req_id, first position, first hidden row, number of rows)
    spans: list[tuple[str, int, int, int]]


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.device
        if self.device == "cpu":
            keep_freed_host_memory()
        self.block_size = config.cache.block_size
        self.vocab_size = config.model.vocab_size
        start = time.perf_counter()
        self.kernels = select_kernels(self.device, config.model.dtype, config.cpu_kernels)
        self.model = get_model(config, self.kernels, self._available_bytes())
        self.load_seconds = time.perf_counter() - start
        self.attention_layers = [
            m for m in self.model.modules() if isinstance(m, AttentionLayerBase)
        ]
        kv_dtype = config.cache.kv_dtype(config.model.dtype)
        self.kv_cache_specs: list[KVCacheSpec] = [
            layer.get_kv_cache_spec(self.block_size, kv_dtype) for layer in self.attention_layers
        ]
        if kv_dtype != config.model.dtype and any(
            not isinstance(spec, FullAttentionSpec) for spec in self.kv_cache_specs
        ):
            raise ValueError(
                f"kv_cache_dtype={config.cache.cache_dtype!r} is for models with full "
                "attention; this model's latent (MLA) cache keeps the model's dtype: "
                "use kv_cache_dtype='auto'"
            )
        use_kv_scales(self.attention_layers, kv_dtype, config.cache.calculate_kv_scales)
        self._kv_calibration_pending = config.cache.calculate_kv_scales
        # verifying k drafts is a decode of 1 + k query tokens
        self.attn_backend = select_attention_backend(
            config.attention_backend, self.kernels, config.decode_query_len, self._spec_type()
        )
        # Steps where every request decodes may run all layers in one kernel call (CPU bf16,
        # or the AVX2 family in fp32 engines).
        self.fused_decode: FusedLlamaDecode | Avx2FusedDecode | None = None
        fused = "off: enforce_eager"
        if not config.enforce_eager:
            self.fused_decode, fused = FusedLlamaDecode.build(
                self.model, self.kernels, self.attn_backend, kv_dtype
            )
        generator = torch.Generator(device=self.device)
        generator.manual_seed(config.model.seed)
        self.sampler = Sampler(generator, self.kernels.op("argmax_bf16"))
        self.spec_decoder = self._build_spec_decoder()
        wm = config.watermark_config
        self.watermarker = (
            Watermarker(wm, self.vocab_size, self.device, self.kernels) if wm else None
        )
        if self.watermarker is not None and self.spec_decoder is not None:
            self.watermarker.speculative = True
            self.spec_decoder.watermarker = self.watermarker
            self.spec_decoder.proposer.watermarker = self.watermarker
        self.structured = StructuredOutputManager(
            config.model.tokenizer,
            self.vocab_size,
            config.model.trust_remote_code,
            config.model.eos_token_ids,
        )
        self.requests: dict[str, CachedRequestState] = {}
        self.hisparse = None  # HiSparse's runner side, once the KV cache exists
        self.input_batch = InputBatch(config.scheduler.max_num_seqs, self.vocab_size, self.device)
        self._log_choices(fused)

    def _spec_type(self) -> type[KVCacheSpec]:
        """The one kind of cache this model's layers keep (one backend serves a whole engine)."""
        kinds = {type(spec) for spec in self.kv_cache_specs}
        if len(kinds) > 1:
            names = ", ".join(sorted(k.__name__ for k in kinds))
            raise ValueError(f"a model mixing attention cache kinds ({names}) is not supported")
        return kinds.pop() if kinds else FullAttentionSpec

    def _build_spec_decoder(self) -> SpecDecoder | None:
        spec = self.config.speculative_config
        if spec is None:
            return None
        proposer: Proposer
        if spec.method == "ngram":
            proposer = NgramProposer(spec.num_speculative_tokens, *spec.prompt_lookup_range)
        else:
            args = (spec, self.config, self.kernels, self.attn_backend, self.sampler)
            if spec.method == "eagle":
                proposer = EagleProposer(*args, target=self.model)
            else:
                proposer = DraftModelProposer(*args, mapped_target=self.model)
            # the draft's layers share the target's blocks: one pool sizes and holds both
            served = self.attn_backend.spec_types
            for draft_spec in proposer.kv_cache_specs:
                if served and not isinstance(draft_spec, served):
                    raise ValueError(
                        f"speculative method {spec.method!r} runs a draft whose cache "
                        f"({type(draft_spec).__name__}) the target's attention backend "
                        f"{self.attn_backend.name!r} cannot hold; use method='ngram' with this model"
                    )
            self.attention_layers += proposer.attention_layers
            self.kv_cache_specs += proposer.kv_cache_specs
        return SpecDecoder(spec, proposer, self.sampler, self.config.scheduler.max_model_len)

    def _available_bytes(self) -> int | None:
        """Host memory this rank may use for prepacked weights (the ranks of one host share it)."""
        if self.device != "cpu":
            return None
        return available_host_bytes() // self.config.parallel.ranks_per_node

    def _log_choices(self, fused: str) -> None:
        where = f"{cpu_model()} [{isa_summary()}]" if self.device == "cpu" else self.device
        methods = [getattr(m, "quant_method", None) for m in self.model.modules()]
        panels = sum(getattr(q, "panel_kernel", None) is not None for q in methods)
        kv_dtype = self.kv_cache_specs[0].dtype if self.kv_cache_specs else None
        logger.info(
            "kernels: %s on %s; attention backend: %s; all-layers decode step: %s%s%s",
            self.kernels.name,
            where,
            self.attn_backend.name,
            fused,
            f"; {panels} linear layers hold bf16 weight panels (fp32 arithmetic)" if panels else "",
            f"; KV cache in {_dtype_name(kv_dtype)}" if kv_dtype is not None else "",
        )
        readable = getattr(self.attn_backend, "supports_cache_dtype", None)
        if kv_dtype is not None and readable is not None and not readable(kv_dtype):
            logger.warning(
                "kv_cache_dtype=%s: the %s attention kernels do not read a %s cache, so "
                "attention runs on the plain-PyTorch path (slower); kv_cache_dtype='auto' "
                "keeps it on the kernels",
                self.config.cache.cache_dtype,
                self.kernels.name,
                _dtype_name(kv_dtype),
            )

    def kv_cache_bytes_per_block(self) -> int:
        return sum(spec.page_size_bytes for spec in self.kv_cache_specs)

    def kv_cache_budget_bytes(self, num_sharing: int = 1) -> int:
        """`kv_cache_memory_bytes` (per rank), else a default share of free memory.

        `num_sharing` ranks of one host split that host's default share (TP on CPU).
        """
        if self.config.cache.kv_cache_memory_bytes:
            return self.config.cache.kv_cache_memory_bytes
        model_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return default_kv_cache_bytes(self.device, model_bytes) // num_sharing

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One tensor per layer, allocated once, in the layout the attention backend chose."""
        for layer, spec in zip(self.attention_layers, self.kv_cache_specs):
            layer.kv_cache = self.attn_backend.allocate_kv_cache(spec, num_blocks, self.device)
        if self.config.hisparse_config is not None:
            self.hisparse = self._build_hisparse(num_blocks)
            self.attn_backend.hisparse = self.hisparse
        if self.spec_decoder is not None:
            self.spec_decoder.proposer.kv_cache_allocated()
        spec = self.config.speculative_config
        if spec is not None and spec.enable_adaptive_verification:
            # timing runs on dummy tokens: calculate_kv_scales must not calibrate on them
            drafter = getattr(self.spec_decoder.proposer, "attention_layers", [])
            with suspended_kv_calibration([*self.attention_layers, *drafter]):
                self.spec_decoder.enable_adaptive(profile_step_cost(self, num_blocks))

    def _build_hisparse(self, num_blocks: int):
        from minivllm.distributed.parallel_state import get_tp_rank
        from minivllm.hisparse.runtime import HiSparseRuntime, host_pool_blocks
        from minivllm.layers.attention.mla import MLAAttention

        config, parallel = self.config.hisparse_config, self.config.parallel
        layers = [layer for layer in self.attention_layers if isinstance(layer, MLAAttention)]
        if not layers or len(layers) != len(self.attention_layers) or not layers[0].is_sparse:
            raise ValueError("HiSparse serves models whose every attention layer is sparse MLA")
        return HiSparseRuntime(
            config,
            layers,
            num_blocks,
            host_pool_blocks(config, self.kv_cache_bytes_per_block()),
            self.block_size,
            config.buffer_rows(self.config.decode_query_len, layers[0].index_topk),
            self.config.model.dtype,
            config.shared_path(parallel.ranks_per_node),
            get_tp_rank() % parallel.ranks_per_node,
        )

    def release(self) -> None:
        """Drop the weights, KV cache and proposer at shutdown, so they go even while
        something still holds the engine object (parameters hold their loaders weakly,
        `WeakLoader`, so a dropped engine is freed by reference counting alone)."""
        for layer in self.attention_layers:
            layer.kv_cache = None
        self.attention_layers = []
        self.model = self.fused_decode = self.spec_decoder = None
        self.requests.clear()

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if self.hisparse is not None:
            self.hisparse.apply(scheduler_output.kv_connector_metadata, self.requests)
        if scheduler_output.is_empty:
            return ModelRunnerOutput()
        inputs = self._prepare_inputs(scheduler_output)
        hidden = self.forward(inputs.input_ids, inputs.positions, inputs.attn)
        if self.spec_decoder is not None and self.spec_decoder.proposer.uses_hidden_states:
            self.spec_decoder.proposer.observe_hidden_states(
                TargetHiddenStates(hidden, inputs.spans)
            )
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        output = ModelRunnerOutput()
        num_sample_rows = len(inputs.sample_req_ids) + sum(map(len, inputs.spec_drafts))
        self._sample(inputs, logits[:num_sample_rows], output)
        self._prompt_logprobs(inputs, logits, output)
        if self.hisparse is not None:
            output.kv_connector_stats = self.hisparse.take_stats()
        return output

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """The decoder's hidden states: in one C++ call when every request decodes and the
        model is on the fused path, else layer by layer."""
        # calculate_kv_scales: the layers calibrate in their own forward, so until they
        # have, every step runs through the model (a first step may only decode: a
        # one-token prompt)
        fused = self.fused_decode is not None and not self._kv_calibration_pending
        if fused and not attn.prefill_req_indices:
            return self.fused_decode(input_ids, positions, attn)
        with forward_context(ForwardContext((self.attn_backend, attn))):
            hidden = self.model(input_ids, positions)
        if self._kv_calibration_pending:
            self._kv_calibration_pending = any(
                getattr(layer, "calibrate_kv_scales", False) for layer in self.attention_layers
            )
        return hidden

    def _update_states(self, out: SchedulerOutput) -> None:
        for req_id in out.removed_req_ids:
            self.requests.pop(req_id, None)
        if self.hisparse is not None:
            self.hisparse.remove(out.removed_req_ids)
        self.input_batch.remove(out.removed_req_ids)
        if self.spec_decoder is not None:
            self.spec_decoder.remove(out.removed_req_ids)
        if self.watermarker is not None:
            self.watermarker.remove(out.removed_req_ids)
        self.structured.remove(out.removed_req_ids)
        eos = self.config.model.eos_token_ids
        for data in out.new_reqs:
            state = CachedRequestState.from_new(data, eos, self.device)
            self.requests[data.req_id] = state
            self.input_batch.add(state)
            self.structured.add(state)
        for data in out.cached_reqs:
            state = self.requests[data.req_id]
            state.block_ids.extend(data.new_block_ids)
            state.num_computed_tokens = data.num_computed_tokens

    def _prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        token_ids, positions, slots = [], [], []
        cu_seqlens_q, seq_lens, block_tables = [0], [], []
        sample_req_ids, sample_rows, prompt_rows, spec_drafts, spans = [], [], [], [], []
        for req_id, num in out.num_scheduled_tokens.items():
            state = self.requests[req_id]
            start, end = state.num_computed_tokens, state.num_computed_tokens + num
            first_row = cu_seqlens_q[-1]
            drafts = out.scheduled_spec_decode_tokens.get(req_id, [])
            tokens = state.token_ids + drafts if drafts else state.token_ids
            token_ids.extend(tokens[start:end])
            positions.extend(range(start, end))
            blocks, size = state.block_ids, self.block_size
            slots.extend(blocks[p // size] * size + p % size for p in range(start, end))
            cu_seqlens_q.append(first_row + num)
            spans.append((req_id, start, first_row, num))
            seq_lens.append(end)
            block_tables.append(blocks)
            if end == len(tokens):  # rows of the last real token and of each draft
                sample_req_ids.append(req_id)
                spec_drafts.append(drafts)
                sample_rows.extend(range(first_row + num - 1 - len(drafts), first_row + num))
            if state.sampling_params.prompt_logprobs is not None:
                last = min(end, state.num_prompt_tokens - 1)  # position p predicts token p + 1
                if last > start:
                    rows = list(range(first_row, first_row + last - start))
                    prompt_rows.append((req_id, rows, state.token_ids[start + 1 : last + 1]))
        prompt_logprob_rows, logits_indices = {}, list(sample_rows)
        for req_id, rows, targets in prompt_rows:
            prompt_logprob_rows[req_id] = (len(logits_indices), targets)
            logits_indices.extend(rows)
        common = build_common_metadata(
            slots,
            cu_seqlens_q,
            seq_lens,
            block_tables,
            self.block_size,
            self.device,
            list(out.num_scheduled_tokens),
        )
        return StepInputs(
            torch.tensor(token_ids, device=self.device),
            torch.tensor(positions, device=self.device),
            self.attn_backend.build_metadata(common),
            sample_req_ids,
            spec_drafts,
            logits_indices,
            prompt_logprob_rows,
            spans,
        )

    def _sample(self, inputs: StepInputs, logits: torch.Tensor, output: ModelRunnerOutput) -> None:
        if not inputs.sample_req_ids:
            return
        states = [self.requests[r] for r in inputs.sample_req_ids]
        if any(inputs.spec_drafts):
            verified = self.spec_decoder.verify(
                logits, states, inputs.spec_drafts, self.input_batch
            )
            emitted, rows = verified.emitted, verified.rows
        else:
            meta = self.input_batch.sampling_metadata(inputs.sample_req_ids)
            meta.token_bitmask = self.structured.bitmask(states)
            if self.watermarker is not None:
                sampled = self.watermarker.sample(self.sampler, logits, meta, states)
            else:
                sampled = self.sampler(logits, meta)
            # Rank 0's draw is the one every TP rank continues from (identity with one rank).
            sampled = tp_broadcast(sampled).tolist()
            emitted, rows = [[t] for t in sampled], [[i] for i in range(len(sampled))]
        self._logprobs(states, emitted, rows, logits, output)
        self.structured.accept(states, emitted)
        for state, tokens in zip(states, emitted):
            state.token_ids.extend(tokens)
            output.sampled_token_ids[state.req_id] = tokens
        self.input_batch.record_sampled(
            [s.req_id for s, tokens in zip(states, emitted) for _ in tokens],
            [t for tokens in emitted for t in tokens],
        )
        if self.spec_decoder is not None:
            output.spec_token_ids = self.spec_decoder.propose(states)

    def _logprobs(
        self,
        states: list[CachedRequestState],
        emitted: list[list[int]],
        rows: list[list[int]],
        logits: torch.Tensor,
        output: ModelRunnerOutput,
    ) -> None:
        """The raw distribution's logprobs of every emitted token (from its own logits row)."""
        want = [i for i, s in enumerate(states) if s.sampling_params.logprobs is not None]
        if not want:
            return
        flat_rows = [r for i in want for r in rows[i]]
        raw = logits[flat_rows].float().log_softmax(dim=-1)
        ks = [states[i].sampling_params.logprobs for i in want for _ in emitted[i]]
        entries = iter(token_logprobs(raw, [t for i in want for t in emitted[i]], ks))
        for i in want:
            output.logprobs[states[i].req_id] = [next(entries) for _ in emitted[i]]

    def _prompt_logprobs(
        self, inputs: StepInputs, logits: torch.Tensor, output: ModelRunnerOutput
    ) -> None:
        for req_id, (first, targets) in inputs.prompt_logprob_rows.items():
            raw = logits[first : first + len(targets)].float().log_softmax(dim=-1)
            k = self.requests[req_id].sampling_params.prompt_logprobs
            output.prompt_logprobs[req_id] = token_logprobs(raw, targets, [k] * len(targets))


def token_logprobs(raw: torch.Tensor, chosen: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """Per row: the chosen token's logprob and rank, then the top-k of the row."""
    chosen_t = torch.tensor(chosen, device=raw.device)
    chosen_lp = raw.gather(1, chosen_t.unsqueeze(1))
    ranks = ((raw > chosen_lp).sum(dim=1) + 1).tolist()
    top_lp, top_ids = raw.topk(max(ks), dim=-1) if max(ks) > 0 else (raw[:, :0], raw[:, :0].long())
    chosen_list, top_lp, top_ids = chosen_lp.squeeze(1).tolist(), top_lp.tolist(), top_ids.tolist()
    return [
        TokenLogprobs(
            [chosen[r]] + top_ids[r][: ks[r]], [chosen_list[r]] + top_lp[r][: ks[r]], ranks[r]
        )
        for r in range(len(chosen))
    ]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
