"""The token-budget scheduler: no prefill or decode phases, only "N more tokens" per request."""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable

from minivllm.config import SchedulerConfig
from minivllm.engine.kv_cache_manager import KVCacheManager
from minivllm.engine.request import Request, RequestStatus
from minivllm.engine.scheduler_output import (
    CachedRequestData,
    EngineCoreOutput,
    HiSparseStats,
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

    After a step that raised (`recover_from_failed_step`), every running request
    is preempted and the step's requests run one at a time (`isolating`) until
    each has produced a token: a step that fails again with one request in it
    names the request that causes the failure, and only that one is failed.

    Waiting requests are admitted first come, first served within a client, and
    across clients (`Request.client_id`) the client with the fewest running
    sequences goes first, so one client's flood cannot starve the others.
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
        self.hisparse_stats: HiSparseStats | None = None  # set with the host tier on
        # after a failed step: these requests run alone, in order, until each passes a step
        self.isolating: deque[str] = deque()

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        while self.isolating and self.isolating[0] not in self.requests:
            self.isolating.popleft()  # finished or aborted meanwhile
        if self.isolating:
            return self._schedule_alone(self.requests[self.isolating[0]])
        return self._schedule()

    def _schedule_alone(self, request: Request) -> SchedulerOutput:
        """A step with only `request` in it. When it cannot get blocks, the requests that
        already passed give theirs back (preempted); when it still cannot, isolation ends
        rather than stalling the engine."""
        output = self._schedule_only(request)
        if output.num_scheduled_tokens:
            return output
        self.removed_req_ids |= output.removed_req_ids  # the empty step is not sent
        for other in reversed([r for r in self.running if r is not request]):
            self.running.remove(other)
            self._preempt(other)
        output = self._schedule_only(request)
        if output.num_scheduled_tokens:
            return output
        self.removed_req_ids |= output.removed_req_ids
        self.isolating.clear()
        return self._schedule()

    def _schedule_only(self, request: Request) -> SchedulerOutput:
        others_running = [r for r in self.running if r is not request]
        others_waiting = [r for r in self.waiting if r is not request]
        self.running = [request] if request.status == RequestStatus.RUNNING else []
        self.waiting = deque([] if self.running else [request])
        try:
            return self._schedule()
        finally:
            self.running += others_running
            self.waiting.extend(others_waiting)

    def recover_from_failed_step(self, suspects: list[str]) -> None:
        """A step raised, leaving its requests' state unknown: recompute every running
        request, and run `suspects` (the failed step's requests) one at a time."""
        for request in reversed(self.running):  # appendleft: the queue keeps their order
            self._preempt(request)
        self.running = []
        self.isolating = deque(r for r in suspects if r in self.requests)

    def _running_per_client(self) -> dict[str | None, int] | None:
        """Sequences running per client, when more than one client waits (else None)."""
        if len({r.client_id for r in self.waiting}) < 2:
            return None
        running: dict[str | None, int] = {}
        for r in self.running:
            running[r.client_id] = running.get(r.client_id, 0) + 1
        return running

    def _next_waiting(self, running: dict[str | None, int] | None) -> Request:
        """The head of the queue (a preempted request first of all), unless another client
        has fewer sequences running: then that client's oldest request."""
        head = self.waiting[0]
        if running is None or head.status == RequestStatus.PREEMPTED:
            return head
        return min(self.waiting, key=lambda r: running.get(r.client_id, 0))  # first of the least

    def _schedule(self) -> SchedulerOutput:
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
        per_client = self._running_per_client()
        while self.waiting and budget > 0 and not preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self._next_waiting(per_client)
            computed_blocks, num_hit = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit, budget)
            lookahead = self.config.num_lookahead_tokens
            if self.kv.allocate_slots(request, num_new, computed_blocks, lookahead) is None:
                break
            self.waiting.remove(request)
            if per_client is not None:
                per_client[request.client_id] = per_client.get(request.client_id, 0) + 1
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
            new_reqs,
            cached_reqs,
            scheduled,
            self.removed_req_ids,
            spec_tokens,
            self.kv.take_step_metadata(),
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
        if runner_output.kv_connector_stats:
            if self.hisparse_stats is None:
                self.hisparse_stats = HiSparseStats()
            self.hisparse_stats.add(runner_output.kv_connector_stats)
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
            if new_token_ids and self.isolating and self.isolating[0] == req_id:
                self.isolating.popleft()  # it ran alone and passed
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
            hisparse=self._hisparse_stats(),
        )

    def _hisparse_stats(self) -> HiSparseStats | None:
        num_host = getattr(self.kv, "num_host_blocks", None)
        if num_host is None:
            return None
        stats = self.hisparse_stats or HiSparseStats()
        return dataclasses.replace(
            stats,
            spills=self.kv.num_spills,
            host_blocks_used=self.kv.host_blocks_used,
            host_blocks_total=num_host,
        )
