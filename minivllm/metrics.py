"""Every Prometheus collector the server exports, in one place (names follow vLLM's, `minivllm:`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from minivllm.engine.scheduler_output import HiSparseStats, SchedulerStats, SpecDecodeStats
from minivllm.outputs import RequestOutput

# Latency buckets in seconds (vLLM's, trimmed): from one fast decode step to a long request.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0)  # fmt: skip
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                40.0, 50.0, 60.0, 120.0, 240.0)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort")


@dataclass(slots=True)
class _RequestTiming:
    """What the metrics remember about one request between its outputs."""

    num_prompt_tokens: int
    has_first_token: bool = False
    last_token_time: dict[int, float] = field(default_factory=dict)  # child index -> time
    finished_children: set[int] = field(default_factory=set)


class EngineMetrics:
    """Collectors for one server, registered in their own `CollectorRegistry`.

    The async engine calls `record_stats` after every step and `record_output`
    for every output it delivers (including the final one of an aborted request).
    """

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"minivllm:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"minivllm:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"minivllm:{name}", doc, labels, buckets=buckets, registry=r).labels(
                model_name
            )

        self.num_requests_running = gauge("num_requests_running", "Sequences in the running batch.")
        self.num_requests_waiting = gauge(
            "num_requests_waiting", "Sequences waiting to be scheduled."
        )
        self.kv_cache_usage = gauge(
            "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)."
        )
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.num_preemptions = counter("num_preemptions", "Sequences preempted (KV cache full).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first generated token.", _TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds",
            "Time between consecutive outputs of one sequence.",
            _ITL_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to the request's last output.", _E2E_BUCKETS
        )
        success = Counter(
            "minivllm:request_success",
            "Finished sequences, by finish reason.",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.request_success = {
            reason: success.labels(model_name, reason) for reason in FINISH_REASONS
        }
        spec = "spec_decode_"
        self.spec_num_drafts = counter(f"{spec}num_drafts", "Verifications (requests with drafts).")
        self.spec_num_draft_tokens = counter(f"{spec}num_draft_tokens", "Draft tokens verified.")
        self.spec_num_accepted_tokens = counter(
            f"{spec}num_accepted_tokens", "Draft tokens accepted."
        )
        self._spec_per_pos = Counter(
            f"minivllm:{spec}num_accepted_tokens_per_pos",
            "Draft tokens accepted, by draft position (0 = the first draft).",
            [*labels, "position"],
            registry=r,
        )
        self._counter, self._gauge = counter, gauge
        self._hisparse: dict[str, Counter | Gauge] | None = None  # made on first HiSparse stats
        self._model_name = model_name
        self._cache_info: Gauge | None = None  # cache_config_info, once the engine exists
        self._last_stats = SchedulerStats()
        self._last_spec = SpecDecodeStats()
        self._timings: dict[str, _RequestTiming] = {}

    def record_stats(self, stats: SchedulerStats) -> None:
        """Gauges take the engine's current state; counters advance by what changed since last time."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        last = self._last_stats
        self.prefix_cache_queries.inc(stats.prefix_cache_queries - last.prefix_cache_queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits - last.prefix_cache_hits)
        self.num_preemptions.inc(stats.num_preemptions - last.num_preemptions)
        if stats.hisparse is not None:
            self._record_hisparse(stats.hisparse, last.hisparse or HiSparseStats())
        self._last_stats = stats
        if stats.spec_decode is not None:
            self._record_spec(stats.spec_decode)

    def _record_hisparse(self, now: HiSparseStats, last: HiSparseStats) -> None:
        """vLLM's `hisparse_*` counters (#56061) and the host pool's use."""
        if self._hisparse is None:
            c, g = self._counter, self._gauge
            self._hisparse = {
                "hits": c("hisparse_cache_hits", "Top-k lookups found in a hot buffer."),
                "misses": c("hisparse_cache_misses", "Top-k lookups copied in from the host pool."),
                "lookups": c(
                    "hisparse_cache_lookups",
                    "Top-k-selected tokens of host-backed requests off the device (hits + misses).",
                ),
                "host_to_device_bytes": c(
                    "hisparse_host_to_device_bytes", "Bytes of KV rows read in from the host pool."
                ),
                "spills": c("hisparse_page_spills", "KV pages moved to the host pool."),
                "used": g("hisparse_host_blocks_used", "Host pool blocks in use."),
                "total": g("hisparse_host_blocks_total", "Host pool blocks."),
                "usage": g(
                    "hisparse_host_cache_usage_perc", "Fraction of host pool blocks in use."
                ),
            }
        m = self._hisparse
        for name in ("hits", "misses", "lookups", "host_to_device_bytes", "spills"):
            m[name].inc(getattr(now, name) - getattr(last, name))
        m["used"].set(now.host_blocks_used)
        m["total"].set(now.host_blocks_total)
        m["usage"].set(now.host_blocks_used / max(now.host_blocks_total, 1))

    def _record_spec(self, spec: SpecDecodeStats) -> None:
        last = self._last_spec
        self.spec_num_drafts.inc(spec.num_drafts - last.num_drafts)
        self.spec_num_draft_tokens.inc(spec.num_draft_tokens - last.num_draft_tokens)
        self.spec_num_accepted_tokens.inc(spec.num_accepted_tokens - last.num_accepted_tokens)
        old = last.num_accepted_tokens_per_pos
        for pos, total in enumerate(spec.num_accepted_tokens_per_pos):
            before = old[pos] if pos < len(old) else 0
            self._spec_per_pos.labels(self._model_name, str(pos)).inc(total - before)
        self._last_spec = SpecDecodeStats(
            spec.num_drafts,
            spec.num_draft_tokens,
            spec.num_accepted_tokens,
            list(spec.num_accepted_tokens_per_pos),
            list(spec.num_draft_tokens_per_pos),
        )

    def record_output(self, output: RequestOutput, now: float | None = None) -> None:
        """Token counts and latencies from one delta output of a request."""
        now = time.time() if now is None else now
        timing = self._timings.get(output.request_id)
        if timing is None:
            timing = self._timings[output.request_id] = _RequestTiming(len(output.prompt_token_ids))
        arrival = output.metrics.arrival_time if output.metrics else now
        for completion in output.outputs:
            num_new = len(completion.token_ids)
            if num_new:
                self._record_tokens(timing, completion.index, num_new, arrival, now)
            if (
                completion.finish_reason is not None
                and completion.index not in timing.finished_children
            ):
                timing.finished_children.add(completion.index)
                counter = self.request_success.get(completion.finish_reason)
                if counter is not None:
                    counter.inc()
        if output.finished:
            self.e2e_request_latency.observe(now - arrival)
            del self._timings[output.request_id]

    def _record_tokens(
        self, timing: _RequestTiming, index: int, num_new: int, arrival: float, now: float
    ) -> None:
        if not timing.has_first_token:
            timing.has_first_token = True
            self.prompt_tokens.inc(timing.num_prompt_tokens)
            self.time_to_first_token.observe(now - arrival)
        last = timing.last_token_time.get(index)
        if last is not None:
            self.inter_token_latency.observe(now - last)
        timing.last_token_time[index] = now
        self.generation_tokens.inc(num_new)

    def record_cache_config(self, cache: object, num_blocks: int) -> None:
        """vLLM's `cache_config_info`: one series, value 1, whose labels are the KV cache's
        settings (`config.CacheConfig`) and its size in blocks."""
        labels = {
            "block_size": str(cache.block_size),
            "cache_dtype": cache.cache_dtype,
            "enable_prefix_caching": str(cache.enable_prefix_caching),
            "num_gpu_blocks": str(num_blocks),  # vLLM's name; the blocks of whatever device
        }
        if self._cache_info is None:
            self._cache_info = Gauge(
                "minivllm:cache_config_info",
                "Information of the KV cache's configuration (the value is 1).",
                ["model_name", *labels],
                registry=self.registry,
            )
        self._cache_info.clear()  # one series: the engine's current settings
        self._cache_info.labels(self._model_name, *labels.values()).set(1)

    def render(self, vllm_alias: bool = False) -> bytes:
        """The registry in Prometheus' text exposition format; with `vllm_alias`, every
        `minivllm:` series a second time under vLLM's `vllm:` name, for existing dashboards."""
        text = generate_latest(self.registry)
        if not vllm_alias:
            return text
        alias = [
            line.replace(b"minivllm:", b"vllm:", 1)
            for line in text.splitlines(keepends=True)
            if b"minivllm:" in line
        ]
        return text + b"".join(alias)
