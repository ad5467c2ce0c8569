"""The synchronous engine: add requests, step, collect outputs."""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

from minivllm.config import EngineConfig
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.input_processor import InputProcessor, PromptType
from minivllm.engine.kv_cache_manager import KVCacheManager
from minivllm.engine.output_processor import (
    OutputKind,
    OutputProcessor,
    ParentRequest,
    child_request_id,
)
from minivllm.engine.request import Request, RequestStatus
from minivllm.engine.scheduler import Scheduler
from minivllm.engine.scheduler_output import SchedulerStats
from minivllm.outputs import RequestMetrics, RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.worker.executor import make_executor

logger = logging.getLogger("minivllm")


class LLMEngine:
    """One loop: `step()` = schedule, execute, update. Everything else is bookkeeping around it."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        start = time.perf_counter()
        self.input_processor = InputProcessor(config.model)
        self.tokenizer = self.input_processor.tokenizer
        self.executor = make_executor(config)
        try:
            num_blocks = self._num_kv_blocks()
            self.executor.allocate_kv_cache(num_blocks)
        except BaseException:
            self.executor.shutdown()  # worker processes, if any, must not outlive a failed start
            raise
        self.kv_cache_manager = self._kv_cache_manager(num_blocks)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager)
        # the request ids of the step in progress; None while the scheduler runs
        self._stepping: list[str] | None = []
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self.startup_seconds = time.perf_counter() - start

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    def _kv_cache_manager(self, num_blocks: int) -> KVCacheManager:
        cache, hisparse = self.config.cache, self.config.hisparse_config
        if hisparse is None:
            return KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        from minivllm.hisparse.coordinator import HiSparseKVCacheManager

        return HiSparseKVCacheManager(
            num_blocks,
            cache.block_size,
            cache.enable_prefix_caching,
            self._num_host_blocks(),
            -(-self._hot_buffer_rows() // cache.block_size),
            hisparse.eager_host_mirror,
        )

    def _num_host_blocks(self) -> int:
        from minivllm.hisparse.runtime import host_pool_blocks

        per_block = self.executor.kv_cache_bytes_per_block()
        return host_pool_blocks(self.config.hisparse_config, per_block)

    def _hot_buffer_rows(self) -> int:
        topk = self.config.model.hf_config.index_topk
        return self.config.hisparse_config.buffer_rows(self.config.decode_query_len, topk)

    def _hisparse_minimum_blocks(self, per_block: int) -> int:
        """With the host tier, the device must hold what one request needs at once: its
        hot buffer, its two tail pages and a full prefill chunk (with lookahead); the
        host pool must hold a whole max_model_len sequence."""
        cache, sched = self.config.cache, self.config.scheduler
        host_blocks = self._num_host_blocks()
        host_needed = -(-sched.max_model_len // cache.block_size) + 2
        if host_blocks < host_needed:
            raise ValueError(
                f"HiSparse's host pool of {self.config.hisparse_config.host_pool_gib} GiB holds "
                f"{host_blocks} blocks; one max_model_len={sched.max_model_len} sequence needs "
                f"{host_needed}: raise host_pool_gib to at least "
                f"{host_needed * per_block / 2**30:.3f} or lower max_model_len"
            )
        chunk = sched.max_num_batched_tokens + sched.num_lookahead_tokens
        return -(-self._hot_buffer_rows() // cache.block_size) + 3 + -(-chunk // cache.block_size)

    def _num_kv_blocks(self) -> int:
        cache = self.config.cache
        per_block = self.executor.kv_cache_bytes_per_block()
        budget = self.executor.kv_cache_budget_bytes()
        num_blocks = budget // per_block
        max_len = self.config.scheduler.max_model_len
        needed = -(-max_len // cache.block_size)
        if self.config.hisparse_config is not None:
            least = self._hisparse_minimum_blocks(per_block)
            if num_blocks < least:
                raise ValueError(
                    f"the KV cache budget of {budget} bytes holds {num_blocks} blocks; with "
                    f"HiSparse one request needs {least} at once (hot buffer, tail pages, a "
                    f"max_num_batched_tokens chunk): raise kv_cache_memory_bytes to at least "
                    f"{least * per_block} or lower max_num_batched_tokens"
                )
        if num_blocks < needed and self.config.hisparse_config is None:
            raise ValueError(
                f"the KV cache budget of {budget} bytes holds {num_blocks * cache.block_size} tokens, "
                f"fewer than one max_model_len={max_len} sequence; raise kv_cache_memory_bytes "
                f"to at least {needed * per_block} or lower max_model_len"
            )
        # More than max_num_seqs full-length sequences can never be resident at once.
        useful = self.config.scheduler.max_num_seqs * needed
        source = "set" if cache.kv_cache_memory_bytes else "default share"
        if num_blocks > useful:
            num_blocks, source = useful, f"{source}, capped at max_num_seqs x max_model_len"
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%s)",
            num_blocks,
            cache.block_size,
            num_blocks * cache.block_size,
            num_blocks * per_block / 2**20,
            source,
        )
        return num_blocks

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        output_kind: OutputKind = OutputKind.FINAL_ONLY,
        cache_salt: str | None = None,
        client_id: str | None = None,
    ) -> str:
        """Validate and queue a request; raises ValueError/TypeError on bad input.

        `client_id` names the sender, so admission can be fair between senders."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        request_id = str(next(self._ids)) if request_id is None else request_id
        child_ids = [child_request_id(request_id, i, params.n) for i in range(params.n)]
        taken = [
            rid
            for rid in {request_id, *child_ids}
            if self.output_processor.has_request(rid) or rid in self.scheduler.requests
        ]
        if taken:  # "0_x" of a request "x" with n=2 would share the scheduler's entry
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.structured_outputs is not None and self.config.speculative_config is not None:
            # the verifier would need each draft position's grammar state; not built yet
            raise ValueError(
                "structured outputs are not supported with speculative decoding yet; "
                "start the engine without speculative_config for constrained requests"
            )
        text, token_ids = self.input_processor.process(prompt, params)
        arrival = time.time() if arrival_time is None else arrival_time
        parent = ParentRequest(
            request_id, text, token_ids, params, output_kind, RequestMetrics(arrival)
        )
        child_params = [self._child_params(params, i) for i in range(params.n)]
        self.output_processor.add_request(parent, child_ids, child_params)
        eos = self.config.model.eos_token_ids
        for child_id, child in zip(child_ids, child_params):
            self.scheduler.add_request(
                Request(child_id, token_ids, child, eos, arrival, cache_salt, client_id)
            )
        return request_id

    @staticmethod
    def _child_params(params: SamplingParams, index: int) -> SamplingParams:
        if params.n == 1:
            return params
        child = params.clone()
        child.n = 1
        if params.seed is not None:
            child.seed = params.seed + index  # distinct but reproducible samples
        return child

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = []
        for request_id in ids:
            child_ids = self.output_processor.child_ids(request_id)
            self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
            output = self.output_processor.abort(request_id)
            if output is not None:
                outputs.append(output)
        return outputs

    def step(self) -> list[RequestOutput]:
        self._stepping = None  # until the scheduler has answered: a failure there is fatal
        scheduler_output = self.scheduler.schedule()
        self._stepping = list(scheduler_output.num_scheduled_tokens)
        runner_output = self.executor.execute(scheduler_output)
        core_outputs = self.scheduler.update(scheduler_output, runner_output)
        outputs, stopped = self.output_processor.process(core_outputs)
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs

    def recover_from_failed_step(self) -> list[str]:
        """After `step` raised: the requests to fail. When the step ran one request alone,
        that request; when it ran several, none: every running request is recomputed and
        the step's requests run one at a time, so a repeat of the failure names its
        request (`Scheduler.recover_from_failed_step`). A failure inside the scheduler
        is no request's: it raises (the caller stops the engine). A step that failed
        with nothing scheduled (no step of ours ran): all of them."""
        stepping, self._stepping = self._stepping, []
        if stepping is None:
            raise RuntimeError("the scheduler failed: the engine's state is unknown")
        if not stepping:
            return list(self.output_processor.parents)
        if len(stepping) == 1:
            parent = self.output_processor.child_to_parent.get(stepping[0])
            return [parent[0].request_id] if parent is not None else []
        self.scheduler.recover_from_failed_step(stepping)
        return []

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents)

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def shutdown(self) -> None:
        self.executor.shutdown()
