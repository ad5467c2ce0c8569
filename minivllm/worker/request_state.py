"""What the model runner remembers about each request between steps."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.engine.scheduler_output import NewRequestData
from minivllm.layers.sampler import SamplingMetadata
from minivllm.sampling_params import SamplingParams


@dataclass(slots=True, eq=False)
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt + outputs the runner has produced
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None

    @classmethod
    def from_new(cls, data: NewRequestData, eos: frozenset[int], device: str) -> CachedRequestState:
        params = data.sampling_params
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(params.seed)
        return cls(
            data.req_id,
            list(data.token_ids),
            data.num_prompt_tokens,
            params,
            list(data.block_ids),
            data.num_computed_tokens,
            eos,
            generator,
        )

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


def build_sampling_metadata(
    states: list[CachedRequestState], vocab_size: int, device: str
) -> SamplingMetadata:
    """Turn the sampling rows' parameters into tensors; optional features cost nothing when unused."""
    params = [s.sampling_params for s in states]
    is_greedy = [p.is_greedy for p in params]
    meta = SamplingMetadata(
        temperature=_tensor(
            [1.0 if g else p.temperature for p, g in zip(params, is_greedy)], device
        ),
        is_greedy=torch.tensor(is_greedy, device=device),
        all_greedy=all(is_greedy),
    )
    if any(p.top_k > 0 for p in params):
        meta.top_k = torch.tensor([p.top_k or vocab_size for p in params], device=device)
    if any(p.top_p < 1.0 for p in params):
        meta.top_p = _tensor([p.top_p for p in params], device)
    if any(p.min_p > 0.0 for p in params):
        meta.min_p = _tensor([p.min_p for p in params], device)
    meta.generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
    _add_penalties(meta, states, vocab_size, device)
    _add_biases(meta, states, vocab_size, device)
    return meta


def _add_penalties(
    meta: SamplingMetadata, states: list[CachedRequestState], vocab_size: int, device: str
) -> None:
    params = [s.sampling_params for s in states]
    use_rep = any(p.repetition_penalty != 1.0 for p in params)
    use_freq = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params)
    if not (use_rep or use_freq):
        return
    counts = torch.zeros(len(states), vocab_size, dtype=torch.int32, device=device)
    for row, state in enumerate(states):
        ids = torch.tensor(state.output_token_ids, dtype=torch.long, device=device)
        counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
    meta.output_token_counts = counts
    if use_rep:
        mask = torch.zeros(len(states), vocab_size, dtype=torch.bool, device=device)
        for row, state in enumerate(states):
            mask[row, state.token_ids[: state.num_prompt_tokens]] = True
        meta.prompt_token_mask = mask
        meta.repetition_penalty = _tensor([p.repetition_penalty for p in params], device)
    if use_freq:
        meta.frequency_penalty = _tensor([p.frequency_penalty for p in params], device)
        meta.presence_penalty = _tensor([p.presence_penalty for p in params], device)


def _add_biases(
    meta: SamplingMetadata, states: list[CachedRequestState], vocab_size: int, device: str
) -> None:
    for row, state in enumerate(states):
        params = state.sampling_params
        if params.logit_bias:
            if meta.logit_bias is None:
                meta.logit_bias = torch.zeros(len(states), vocab_size, device=device)
            for token_id, bias in params.logit_bias.items():
                meta.logit_bias[row, token_id] = bias
        if len(state.output_token_ids) < params.min_tokens:
            banned = set(params.all_stop_token_ids)
            if not params.ignore_eos:
                banned |= state.eos_token_ids
            if banned:
                meta.banned_token_ids[row] = sorted(banned)


def _tensor(values: list[float], device: str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)
