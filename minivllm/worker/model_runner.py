"""The model runner: SchedulerOutput in, sampled tokens out. It never calls back."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minivllm.config import EngineConfig
from minivllm.distributed.parallel_state import tp_broadcast
from minivllm.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from minivllm.layers.attention import Attention
from minivllm.layers.forward_context import AttentionMetadata, forward_context
from minivllm.layers.sampler import Sampler
from minivllm.loader.model_loader import load_model
from minivllm.worker.request_state import CachedRequestState, build_sampling_metadata

logger = logging.getLogger("minivllm")


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
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
        self.model = load_model(config.model, self.device)
        self.load_seconds = time.perf_counter() - start
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        # Steps where every request decodes may run all layers in one kernel call (CPU bf16).
        self.fused_decode: Callable[..., torch.Tensor] | None = None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(config.model.seed)
        self.sampler = Sampler(generator)
        self._select_cpu_kernels()
        self.requests: dict[str, CachedRequestState] = {}

    def _select_cpu_kernels(self) -> None:
        if not (self.config.cpu_kernels and self.device == "cpu"):
            return
        if self.config.model.dtype != torch.bfloat16:
            return
        from minivllm.engine.arg_utils import available_host_bytes
        from minivllm.kernels import get_cpu_kernels
        from minivllm.layers.cpu_linear import use_cpu_kernels

        kernels = get_cpu_kernels()
        if kernels is None:
            return
        # the ranks of one host share its memory
        available = available_host_bytes() // self.config.parallel.ranks_per_node
        count = use_cpu_kernels(self.model, kernels, available)
        self.sampler.argmax_kernel = kernels.argmax_bf16
        for layer in self.attention_layers:
            layer.cache_write_kernel = kernels.write_kv_cache
            if layer.head_dim % 32 == 0:
                layer.prefill_kernel = kernels.prefill_attention
                if layer.head_dim <= 256:  # the decode kernel's templates go up to 256
                    layer.decode_kernel = kernels.paged_attention_decode
        from minivllm.layers.fused_decode import FusedLlamaDecode

        self.fused_decode = FusedLlamaDecode.build(self.model, kernels)
        logger.info(
            "bf16 CPU kernels on: %d linear layers, paged decode and prefill attention%s",
            count,
            ", all decoder layers fused for decode steps" if self.fused_decode else "",
        )

    def kv_cache_bytes_per_block(self) -> int:
        dtype_size = torch.empty(0, dtype=self.config.model.dtype).element_size()
        return sum(
            2 * self.block_size * layer.num_kv_heads * layer.head_dim * dtype_size
            for layer in self.attention_layers
        )

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One tensor per layer, allocated once: [2, num_kv_heads, num_blocks, block_size, head_dim].

        Not zeroed (that alone took seconds for a few GB): attention reads only
        slots it has written, and masks the padding it gathers.
        """
        for layer in self.attention_layers:
            layer.kv_cache = torch.empty(
                2,
                layer.num_kv_heads,
                num_blocks,
                self.block_size,
                layer.head_dim,
                dtype=self.config.model.dtype,
                device=self.device,
            )

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return ModelRunnerOutput()
        inputs = self._prepare_inputs(scheduler_output)
        if self.fused_decode is not None and not inputs.attn.prefill_req_indices:
            hidden = self.fused_decode(inputs.input_ids, inputs.positions, inputs.attn)
        else:
            with forward_context(inputs.attn):
                hidden = self.model(inputs.input_ids, inputs.positions)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        output = ModelRunnerOutput()
        self._sample(inputs, logits[: len(inputs.sample_req_ids)], output)
        self._prompt_logprobs(inputs, logits, output)
        return output

    def _update_states(self, out: SchedulerOutput) -> None:
        for req_id in out.removed_req_ids:
            self.requests.pop(req_id, None)
        eos = self.config.model.eos_token_ids
        for data in out.new_reqs:
            self.requests[data.req_id] = CachedRequestState.from_new(data, eos, self.device)
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
        attn = self._attention_metadata(slots, cu_seqlens_q, seq_lens, block_tables)
        return StepInputs(
            torch.tensor(token_ids, device=self.device),
            torch.tensor(positions, device=self.device),
            attn,
            sample_req_ids,
            logits_indices,
            prompt_logprob_rows,
        )

    def _attention_metadata(
        self,
        slots: list[int],
        cu_seqlens_q: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
    ) -> AttentionMetadata:
        num_reqs = len(seq_lens)
        decodes = [i for i in range(num_reqs) if cu_seqlens_q[i + 1] - cu_seqlens_q[i] == 1]
        decode_set = set(decodes)
        max_blocks = max((len(block_tables[i]) for i in decodes), default=0)
        padded = [block_tables[i] + [0] * (max_blocks - len(block_tables[i])) for i in decodes]
        dev = self.device
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=dev),
            cu_seqlens_q=cu_seqlens_q,
            seq_lens=seq_lens,
            block_tables=block_tables,
            decode_req_indices=decodes,
            decode_token_indices=torch.tensor([cu_seqlens_q[i] for i in decodes], device=dev),
            decode_block_tables=torch.tensor(padded, dtype=torch.long, device=dev).view(
                len(decodes), max_blocks
            ),
            decode_seq_lens=torch.tensor([seq_lens[i] for i in decodes], device=dev),
            prefill_req_indices=[i for i in range(num_reqs) if i not in decode_set],
        )

    def _sample(self, inputs: StepInputs, logits: torch.Tensor, output: ModelRunnerOutput) -> None:
        if not inputs.sample_req_ids:
            return
        states = [self.requests[r] for r in inputs.sample_req_ids]
        meta = build_sampling_metadata(states, self.vocab_size, self.device)
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
