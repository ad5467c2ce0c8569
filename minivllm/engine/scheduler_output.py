"""The frozen data contract between the scheduler and the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minivllm.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has no state for: sent in full (also after a preemption)."""

    req_id: str
    token_ids: list[int]  # prompt + outputs so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner already tracks: only what changed."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData]
    # req_id -> tokens to compute this step, in batch order.
    num_scheduled_tokens: dict[str, int]
    # Requests the runner must forget (finished, aborted or preempted since the last step).
    removed_req_ids: set[str] = field(default_factory=set)
    # req_id -> draft tokens to verify this step, after its last real token (in
    # num_scheduled_tokens); drafts the budget or the length limits cut are dropped.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # the KV manager's instructions to the runner for this step (HiSparse: page spills)
    kv_connector_metadata: Any = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass(slots=True)
class TokenLogprobs:
    """Raw logprobs at one position: the chosen token first, then the top-k."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int  # rank of the chosen token, 1 = most likely


@dataclass(slots=True)
class ModelRunnerOutput:
    # req_id -> tokens sampled this step (one, or several under speculative decoding).
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # req_id -> logprobs of the prompt tokens this step's chunk predicted.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # req_id -> draft tokens proposed for the next step (speculative decoding).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # HiSparse's resolver counts of this step (lookups, hits, misses, host_to_device_bytes)
    kv_connector_stats: dict[str, int] | None = None


@dataclass(slots=True)
class EngineCoreOutput:
    """What one step did to one request."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0


@dataclass(slots=True)
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0  # total since start
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    spec_decode: SpecDecodeStats | None = None  # totals since start, with speculative decoding
    hisparse: HiSparseStats | None = None  # totals since start, with HiSparse on


@dataclass(slots=True)
class HiSparseStats:
    """HiSparse's totals (vLLM's `hisparse_*` counters) and its host pool's use.

    A lookup is one top-k-selected token of a host-backed request whose page is not
    resident, per layer and step (a token selected by several query rows of one
    verification counts once): a hit finds it in the request's hot buffer, a miss
    copies its row in from the host pool."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    host_to_device_bytes: int = 0
    spills: int = 0  # pages moved to the host pool
    host_blocks_used: int = 0
    host_blocks_total: int = 0

    def add(self, counts: dict[str, int]) -> None:
        for name in ("lookups", "hits", "misses", "host_to_device_bytes"):
            setattr(self, name, getattr(self, name) + counts.get(name, 0))


@dataclass(slots=True)
class SpecDecodeStats:
    """Speculative decoding totals (vLLM's `spec_decode_*` counters)."""

    num_drafts: int = 0  # verification runs: requests that had drafts in a step
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # position i -> drafts accepted at draft position i
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # position i -> verifications that had a draft at position i
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for per_pos in (self.num_accepted_tokens_per_pos, self.num_draft_tokens_per_pos):
            per_pos += [0] * (num_drafted - len(per_pos))
        for pos in range(num_drafted):
            self.num_draft_tokens_per_pos[pos] += 1
            self.num_accepted_tokens_per_pos[pos] += pos < num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification: accepted drafts plus the one the target adds."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
