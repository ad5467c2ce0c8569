"""`GetLoads`: the scheduler's load as the gateway's routing reads it (one data-parallel rank)."""

from __future__ import annotations

import time
from collections import deque
from datetime import datetime, timezone
from typing import NamedTuple

from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from minivllm import __version__
from minivllm.engine.llm_engine import LLMEngine
from minivllm.metrics import EngineMetrics

_GENERATION_TOKENS = "minivllm:generation_tokens"


class _Sample(NamedTuple):
    time: float
    generated: float  # tokens generated since start
    queries: int  # prompt tokens looked up in the prefix cache since start
    hits: int  # of them, found


class LoadReporter:
    """Answers `GetLoads` from the engine's scheduler stats and the server's metrics.

    Throughput and prefix-cache hit rate are rates over the polls of the last
    `window` seconds (at least the last two polls): tokens generated per second,
    cached over looked-up prompt tokens. The first poll reports zero for both.
    `num_waiting_uncached_tokens` stays 0 (unknown: waiting requests have not
    looked up the cache yet).
    """

    def __init__(self, engine: LLMEngine, metrics: EngineMetrics, window: float = 10.0) -> None:
        self.engine = engine
        self.metrics = metrics
        self.window = window
        self._samples: deque[_Sample] = deque()

    def loads(self) -> pb.GetLoadsResponse:
        stats = self.engine.stats()
        config = self.engine.config
        capacity = self.engine.kv_cache_manager.pool.num_blocks * config.cache.block_size
        now = _Sample(
            time.monotonic(), self._generated(), stats.prefix_cache_queries, stats.prefix_cache_hits
        )
        past = self._oldest_in_window(now)
        elapsed = now.time - past.time
        queried = now.queries - past.queries
        load = pb.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=stats.num_running,
            num_waiting_reqs=stats.num_waiting,
            num_total_reqs=stats.num_running + stats.num_waiting,
            num_used_tokens=round(stats.kv_cache_usage * capacity),
            max_total_num_tokens=capacity,
            token_usage=stats.kv_cache_usage,
            gen_throughput=(now.generated - past.generated) / elapsed if elapsed > 0 else 0.0,
            cache_hit_rate=(now.hits - past.hits) / queried if queried > 0 else 0.0,
            utilization=stats.kv_cache_usage,
            max_running_requests=config.scheduler.max_num_seqs,
        )
        return pb.GetLoadsResponse(
            timestamp=datetime.now(timezone.utc).isoformat(),
            version=__version__,
            dp_rank_count=1,
            loads=[load],
        )

    def _oldest_in_window(self, now: _Sample) -> _Sample:
        """Record `now`; return the newest sample at least `window` old (else the oldest)."""
        self._samples.append(now)
        while len(self._samples) > 2 and now.time - self._samples[1].time >= self.window:
            self._samples.popleft()
        return self._samples[0]

    def _generated(self) -> float:
        for family in self.metrics.registry.collect():
            if family.name == _GENERATION_TOKENS:
                return sum(s.value for s in family.samples if s.name.endswith("_total"))
        return 0.0
