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
from minivllm.layers.attention import Attention, CommonAttentionMetadata, KVCacheSpec
from minivllm.layers.attention.registry import select_attention_backend
from minivllm.layers.forward_context import ForwardContext, forward_context
from minivllm.layers.fused_decode import FusedLlamaDecode
from minivllm.layers.sampler import Sampler
from minivllm.loader.model_loader import load_model
from minivllm.utils.memory import available_host_bytes, default_kv_cache_bytes
from minivllm.worker.input_batch import InputBatch
from minivllm.worker.request_state import CachedRequestState

logger = logging.getLogger("minivllm")


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: Any  # the attention backend's metadata for this step
    sample_req_ids: list[str]  # requests whose last scheduled token yields a new token
    logits_indices: list[int]  # hidden rows to project: sampling rows, then prompt-logprob rows
    # req_id -> (first row in logits_indices, target prompt token ids)
    prompt_logprob_rows: dict[str, tuple[int, list[int]]]


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.device
        self.block_size = config.cache.block_size
        self.vocab_size = config.model.vocab_size
        start = time.perf_counter()
        self.kernels = select_kernels(self.device, config.model.dtype, config.cpu_kernels)
        self.model = load_model(config.model, self.device, self.kernels, self._available_bytes())
        self.load_seconds = time.perf_counter() - start
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.kv_cache_specs: list[KVCacheSpec] = [
            layer.get_kv_cache_spec(self.block_size, config.model.dtype)
            for layer in self.attention_layers
        ]
        self.attn_backend = select_attention_backend(config.attention_backend, self.kernels)
        # Steps where every request decodes may run all layers in one kernel call (CPU bf16).
        self.fused_decode: FusedLlamaDecode | None = None
        fused = "off: enforce_eager"
        if not config.enforce_eager:
            self.fused_decode, fused = FusedLlamaDecode.build(
                self.model, self.kernels, self.attn_backend
            )
        generator = torch.Generator(device=self.device)
        generator.manual_seed(config.model.seed)
        self.sampler = Sampler(generator, self.kernels.op("argmax_bf16"))
        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch = InputBatch(config.scheduler.max_num_seqs, self.vocab_size, self.device)
        self._log_choices(fused)

    def _available_bytes(self) -> int | None:
        """Host memory this rank may use for prepacked weights (the ranks of one host share it)."""
        if self.device != "cpu":
            return None
        return available_host_bytes() // self.config.parallel.ranks_per_node

    def _log_choices(self, fused: str) -> None:
        where = f"{cpu_model()} [{isa_summary()}]" if self.device == "cpu" else self.device
        logger.info(
            "kernels: %s on %s; attention backend: %s; all-layers decode step: %s",
            self.kernels.name,
            where,
            self.attn_backend.name,
            fused,
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

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return ModelRunnerOutput()
        inputs = self._prepare_inputs(scheduler_output)
        if self.fused_decode is not None and not inputs.attn.prefill_req_indices:
            hidden = self.fused_decode(inputs.input_ids, inputs.positions, inputs.attn)
        else:
            with forward_context(ForwardContext((self.attn_backend, inputs.attn))):
                hidden = self.model(inputs.input_ids, inputs.positions)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        output = ModelRunnerOutput()
        self._sample(inputs, logits[: len(inputs.sample_req_ids)], output)
        self._prompt_logprobs(inputs, logits, output)
        return output

    def _update_states(self, out: SchedulerOutput) -> None:
        for req_id in out.removed_req_ids:
            self.requests.pop(req_id, None)
        self.input_batch.remove(out.removed_req_ids)
        eos = self.config.model.eos_token_ids
        for data in out.new_reqs:
            state = CachedRequestState.from_new(data, eos, self.device)
            self.requests[data.req_id] = state
            self.input_batch.add(state)
        for data in out.cached_reqs:
            state = self.requests[data.req_id]
            state.block_ids.extend(data.new_block_ids)
            state.num_computed_tokens = data.num_computed_tokens

    def _prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        token_ids, positions, slots = [], [], []
        cu_seqlens_q, seq_lens, block_tables = [0], [], []
        sample_req_ids, sample_rows, prompt_rows = [], [], []
        for req_id, num in out.num_scheduled_tokens.items():
            state = self.requests[req_id]
            start, end = state.num_computed_tokens, state.num_computed_tokens + num
            first_row = cu_seqlens_q[-1]
            token_ids.extend(state.token_ids[start:end])
            positions.extend(range(start, end))
            blocks, size = state.block_ids, self.block_size
            slots.extend(blocks[p // size] * size + p % size for p in range(start, end))
            cu_seqlens_q.append(first_row + num)
            seq_lens.append(end)
            block_tables.append(blocks)
            if end == len(state.token_ids):
                sample_req_ids.append(req_id)
                sample_rows.append(first_row + num - 1)
            if state.sampling_params.prompt_logprobs is not None:
                last = min(end, state.num_prompt_tokens - 1)  # position p predicts token p + 1
                if last > start:
                    rows = list(range(first_row, first_row + last - start))
                    prompt_rows.append((req_id, rows, state.token_ids[start + 1 : last + 1]))
        prompt_logprob_rows, logits_indices = {}, list(sample_rows)
        for req_id, rows, targets in prompt_rows:
            prompt_logprob_rows[req_id] = (len(logits_indices), targets)
            logits_indices.extend(rows)
        common = self._common_metadata(slots, cu_seqlens_q, seq_lens, block_tables)
        return StepInputs(
            torch.tensor(token_ids, device=self.device),
            torch.tensor(positions, device=self.device),
            self.attn_backend.build_metadata(common),
            sample_req_ids,
            logits_indices,
            prompt_logprob_rows,
        )

    def _common_metadata(
        self,
        slots: list[int],
        cu_seqlens_q: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
    ) -> CommonAttentionMetadata:
        num_blocks = [len(blocks) for blocks in block_tables]
        width = max(num_blocks, default=0)
        padded = [blocks + [0] * (width - len(blocks)) for blocks in block_tables]
        return CommonAttentionMetadata(
            query_start_loc=cu_seqlens_q,
            seq_lens=seq_lens,
            num_blocks=num_blocks,
            block_table=torch.tensor(padded, dtype=torch.long, device=self.device).view(
                len(padded), width
            ),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            block_size=self.block_size,
        )

    def _sample(self, inputs: StepInputs, logits: torch.Tensor, output: ModelRunnerOutput) -> None:
        if not inputs.sample_req_ids:
            return
        states = [self.requests[r] for r in inputs.sample_req_ids]
        meta = self.input_batch.sampling_metadata(inputs.sample_req_ids)
        # Rank 0's draw is the one every TP rank continues from (identity with one rank).
        sampled = tp_broadcast(self.sampler(logits, meta)).tolist()
        want = [i for i, s in enumerate(states) if s.sampling_params.logprobs is not None]
        if want:
            raw = logits[want].float().log_softmax(dim=-1)
            ks = [states[i].sampling_params.logprobs for i in want]
            entries = token_logprobs(raw, [sampled[i] for i in want], ks)
            for i, entry in zip(want, entries):
                output.logprobs[states[i].req_id] = [entry]
        for state, token_id in zip(states, sampled):
            state.token_ids.append(token_id)
            output.sampled_token_ids[state.req_id] = [token_id]
        self.input_batch.record_sampled(inputs.sample_req_ids, sampled)

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
