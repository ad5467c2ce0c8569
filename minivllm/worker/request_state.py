"""What the model runner remembers about each request between steps."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.engine.scheduler_output import NewRequestData
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
