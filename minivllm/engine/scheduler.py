"""The token-budget scheduler: no prefill or decode phases, only "N more tokens" per request."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from minivllm.config import SchedulerConfig
from minivllm.engine.kv_cache_manager import KVCacheManager
from minivllm.engine.request import Request, RequestStatus
from minivllm.engine.scheduler_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
    SpecDecodeStats,
)


class Scheduler:
    """Hands out a per-step token budget, running requests first, then waiting ones (FCFS).

    When the pool runs out of blocks, the newest running request is preempted:
    its blocks are freed and it goes back to the head of the queue, to be
    recomputed from its prompt and the tokens it had already produced.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.removed_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.spec_stats: SpecDecodeStats | None = None  # set when drafts are proposed

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        num_preemptions_before = self.num_preemptions
        spec_tokens: dict[str, list[int]] = {}

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._num_new_tokens(request, budget)
            new_blocks = self._allocate_or_preempt(request, num_new)
            if new_blocks is None:  # the request preempted itself
                break
            scheduled[request.request_id] = num_new
            budget -= num_new
            # drafts follow the real tokens; the budget may have cut some
            num_drafts = num_new - (request.num_tokens - request.num_computed_tokens)
            if num_drafts > 0:
                spec_tokens[request.request_id] = request.spec_token_ids[:num_drafts]
            cached_reqs.append(
                CachedRequestData(
                    request.request_id,
                    [b.block_id for b in new_blocks],
                    request.num_computed_tokens,
                )
            )
            i += 1

        preempted = self.num_preemptions > num_preemptions_before
        while self.waiting and budget > 0 and not preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting[0]
            computed_blocks, num_hit = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit, budget)
            lookahead = self.config.num_lookahead_tokens
            if self.kv.allocate_slots(request, num_new, computed_blocks, lookahead) is None:
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled[request.request_id] = num_new
            budget -= num_new
            new_reqs.append(
                NewRequestData(
                    request.request_id,
                    list(request.all_token_ids),
                    request.num_prompt_tokens,
                    request.sampling_params,
                    self.kv.block_ids(request.request_id),
                    num_hit,
                )
            )

        output = SchedulerOutput(
            new_reqs, cached_reqs, scheduled, self.removed_req_ids, spec_tokens
        )
        self.removed_req_ids = set()
        for req_id, num in scheduled.items():
            self.requests[req_id].num_computed_tokens += num
        return output

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        """The rest of the request's real tokens, then its drafts, as far as the budget goes."""
        num_pending = request.num_tokens + len(request.spec_token_ids)
        return min(num_pending - request.num_computed_tokens, budget)

    def _allocate_or_preempt(self, request: Request, num_new: int) -> list | None:
        lookahead = self.config.num_lookahead_tokens
        while True:
            new_blocks = self.kv.allocate_slots(request, num_new, None, lookahead)
            if new_blocks is not None:
                return new_blocks
            victim = self.running.pop()
            self._preempt(victim)
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.removed_req_ids.add(request.request_id)
        self.waiting.appendleft(request)

    def update(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply token-level stop rules, free finished requests."""
        outputs = []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.status.is_finished:
                continue  # aborted while the step ran
            new_token_ids = runner_output.sampled_token_ids.get(req_id, [])
            prompt_logprobs = runner_output.prompt_logprobs.get(req_id)
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts:  # the rejected drafts' KV slots are free to be written again
                num_accepted = len(new_token_ids) - 1
                request.num_computed_tokens -= len(drafts) - num_accepted
                self._observe_spec(len(drafts), num_accepted)
            request.spec_token_ids = runner_output.spec_token_ids.get(req_id, [])
            if not new_token_ids and prompt_logprobs is None:
                continue  # a prompt chunk: nothing to report yet
            kept = self._append_and_check_stop(request, new_token_ids)
            logprobs = runner_output.logprobs.get(req_id)
            outputs.append(
                EngineCoreOutput(
                    req_id,
                    kept,
                    request.status.finish_reason,
                    request.stop_reason,
                    logprobs[: len(kept)] if logprobs is not None else None,
                    prompt_logprobs,
                    request.num_cached_tokens or 0,
                )
            )
            if request.status.is_finished:
                self._free(request)
        return outputs

    def _observe_spec(self, num_drafted: int, num_accepted: int) -> None:
        if self.spec_stats is None:
            self.spec_stats = SpecDecodeStats()
        self.spec_stats.observe(num_drafted, num_accepted)

    def _append_and_check_stop(self, request: Request, token_ids: list[int]) -> list[int]:
        kept = []
        for token_id in token_ids:
            request.append_output_token_ids([token_id])
            kept.append(token_id)
            status = self._check_stop(request, token_id)
            if status is not None:
                request.status = status
                break
        return kept

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        # vLLM's order: length first, then (past min_tokens) EOS and stop token ids.
        params = request.sampling_params
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_output_tokens < params.min_tokens:
            return None
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.all_stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        return None

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside the step (abort, or a stop string found by the detokenizer)."""
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None or request.status.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)

    def _free(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        self.kv.free(request)
        self.removed_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.kv.num_queries,
            prefix_cache_hits=self.kv.num_hits,
            spec_decode=self.spec_stats,
        )
