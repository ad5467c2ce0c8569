"""`AsyncLLM`: an asyncio front over the synchronous engine, for the server.

    clients ──generate()──► add_request ─┐            ┌─► per-request asyncio.Queue ──► client
                                         ▼            │
                          one loop task: [aborts] → step (engine thread) → dispatch
                          (sleeps on an Event while the engine has no work)

The engine is not thread-safe, so every call into it (add, abort, step) happens
while holding `self._lock`; `step` runs on a single dedicated thread so the event
loop keeps serving HTTP while the model computes. Requests arriving during a step
wait on the lock and join the next step: that is how many clients share a batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.input_processor import PromptType
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.output_processor import OutputKind
from minivllm.metrics import EngineMetrics
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.worker.local_workers import WorkerError

logger = logging.getLogger("minivllm")


class EngineDeadError(RuntimeError):
    """The engine failed in a way it cannot recover from, or it is shutting down."""


class QueueFullError(RuntimeError):
    """The engine's queue cannot take the request's sequences now (`max_waiting`)."""

    def __init__(self, num_waiting: int, num_new: int, limit: int) -> None:
        super().__init__(
            f"the server is busy: {num_waiting} sequences wait for the engine and this request "
            f"adds {num_new} (limit {limit}); retry later"
        )


class EngineStepError(RuntimeError):
    """A step raised; the requests in it were aborted, and the engine keeps serving others."""


class RequestStream:
    """One request's outputs, in order; iterate it, then `close()` it (which aborts if unfinished)."""

    def __init__(
        self,
        owner: AsyncLLM,
        request_id: str,
        queue: asyncio.Queue[RequestOutput | BaseException],
    ) -> None:
        self.owner = owner
        self.request_id = request_id
        self._queue = queue
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True  # the engine already dropped the request
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        self.owner._forget(self.request_id, abort=not self.finished)
        self.finished = True


def _engine_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="minivllm-engine")


class AsyncLLM:
    """Owns an `LLMEngine` and steps it from one background task while work exists.

    Call `start()` from the event loop before `generate`, and `shutdown()` at the end.
    """

    def __init__(
        self,
        engine: LLMEngine,
        metrics: EngineMetrics | None = None,
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._pending_aborts: set[str] = set()
        self._executor = executor or _engine_thread()
        self._lock: asyncio.Lock | None = None
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._shutdown_task: asyncio.Future | None = None
        self.dead_error: EngineDeadError | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs, metrics: EngineMetrics | None = None) -> AsyncLLM:
        """Build the engine on the thread that will step it.

        Every thread that runs parallel torch ops gets its own OpenMP team. Had the
        model been loaded on the caller's thread, its idle team would count against
        the cores, libgomp would stop spinning between parallel regions and wake its
        workers through futexes instead, and each of a decode step's ~250 regions
        would cost ~30 us more: measured 53-55 against 38-48 ms per token at batch 1
        on 2 cores, ~20 ms more per 128-token prefill.
        """
        executor = _engine_thread()
        try:
            engine = executor.submit(LLMEngine.from_engine_args, args).result()
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return cls(engine, metrics, executor)

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    @property
    def has_shut_down(self) -> bool:
        """`shutdown()` was called (it frees the engine); until then the owner must."""
        return self._shutdown_task is not None

    def start(self) -> None:
        self._lock = asyncio.Lock()
        self._wakeup = asyncio.Event()
        self._loop_task = asyncio.get_running_loop().create_task(self._run(), name="engine-loop")
        if self.metrics is not None:
            self.metrics.record_stats(self.engine.stats())

    async def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        cache_salt: str | None = None,
        client_id: str | None = None,
        max_waiting: int | None = None,
    ) -> RequestStream:
        """Queue a request now and return its output stream.

        With `max_waiting`, `QueueFullError` when the queue would then hold more waiting
        sequences (checked under the engine lock, so concurrent requests cannot all pass).

        Raises ValueError/TypeError (bad input) or `EngineDeadError` here, before
        any output. The caller must `close()` the stream when done with it:
        closing one that has not finished aborts the request.
        """
        if self.dead_error is not None:
            raise self.dead_error
        assert self._lock is not None and self._wakeup is not None, "call start() first"
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        async with self._lock:
            if self.dead_error is not None:
                raise self.dead_error
            waiting = self.engine.stats().num_waiting
            if max_waiting is not None and waiting + params.n > max_waiting:
                raise QueueFullError(waiting, params.n, max_waiting)
            self.engine.add_request(
                request_id,
                prompt,
                params,
                output_kind=OutputKind.DELTA,
                cache_salt=cache_salt,
                client_id=client_id,
            )
            self._streams[request_id] = queue
        self._wakeup.set()
        return RequestStream(self, request_id, queue)

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as they are produced (`OutputKind.DELTA`: new tokens only).

        An engine failure raises `EngineStepError` or `EngineDeadError` from the
        iterator. Leaving the iteration early (a client disconnect) aborts the request.
        """
        stream = await self.add_request(prompt, params, request_id, cache_salt)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, between steps; False (nothing done) while requests run."""
        assert self._lock is not None, "call start() first"
        async with self._lock:
            if self.engine.has_unfinished_requests():
                return False
            self.engine.kv_cache_manager.pool.reset_prefix_cache()
            return True

    def _forget(self, request_id: str, abort: bool) -> None:
        if self._streams.pop(request_id, None) is not None and abort:
            self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent). Queued: the loop applies it before its next step."""
        self._pending_aborts.add(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    async def _run(self) -> None:
        assert self._lock is not None and self._wakeup is not None
        while self.dead_error is None:  # a dead engine stops its loop (nothing can run)
            await self._wakeup.wait()
            self._wakeup.clear()
            async with self._lock:
                try:
                    await self._step()
                except Exception as exc:  # any failure must fail the requests, never hang them
                    self._fail_in_flight(exc)
            if self.engine.has_unfinished_requests() or self._pending_aborts:
                self._wakeup.set()

    async def _step(self) -> None:
        """Apply queued aborts, then run one engine step (on the engine thread) if there is work."""
        self._apply_aborts()
        if self.engine.has_unfinished_requests():
            loop = asyncio.get_running_loop()
            outputs = await loop.run_in_executor(self._executor, self.engine.step)
            self._dispatch(outputs)
        self._record_stats()

    def _apply_aborts(self) -> None:
        if not self._pending_aborts:
            return
        ids, self._pending_aborts = list(self._pending_aborts), set()
        for output in self.engine.abort_request(ids):
            self._deliver(output)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.time()
        for output in outputs:
            self._deliver(output, now)

    def _deliver(self, output: RequestOutput, now: float | None = None) -> None:
        if self.metrics is not None:
            self.metrics.record_output(output, now)
        queue = (self._streams.pop if output.finished else self._streams.get)(
            output.request_id, None
        )
        if queue is not None:
            queue.put_nowait(output)

    def _record_stats(self) -> None:
        if self.metrics is not None:
            self.metrics.record_stats(self.engine.stats())

    def _fail_in_flight(self, exc: Exception) -> None:
        """A step raised: fail the request that caused it, if the step ran it alone; else
        the engine reruns the step's requests one at a time to find it
        (`LLMEngine.recover_from_failed_step`), and the others go on unharmed. A lost
        tensor-parallel rank, or a failed recovery, stops the engine."""
        error = EngineStepError(
            f"the engine failed while running this request ({type(exc).__name__})"
        )
        try:
            if isinstance(exc, WorkerError):  # a tensor-parallel rank is gone: nothing can run
                raise exc
            culprits = self.engine.recover_from_failed_step()
            logger.error(
                "engine step failed (%s: %s); %s",
                type(exc).__name__,
                str(exc)[:200],
                f"failing request {culprits[0]}"
                if culprits
                else "rerunning its requests one at a time to find the cause",
                exc_info=exc,
            )
            for output in self.engine.abort_request(culprits):
                if self.metrics is not None:
                    self.metrics.record_output(output)
            for request_id in culprits:
                queue = self._streams.pop(request_id, None)
                if queue is not None:
                    queue.put_nowait(error)
        except Exception:
            logger.exception("could not recover the engine after a failed step")
            self.dead_error = EngineDeadError("the engine stopped after an internal error")
            with contextlib.suppress(Exception):  # a dead engine may not abort cleanly
                self._abort_all()
            self._fail_streams(self.dead_error)
        self._record_stats()

    def _abort_all(self) -> None:
        request_ids = [*self._streams, *self._pending_aborts]
        self._pending_aborts.clear()
        for output in self.engine.abort_request(request_ids):
            if self.metrics is not None:
                self.metrics.record_output(output)

    def _fail_streams(self, error: Exception) -> None:
        streams, self._streams = self._streams, {}
        for queue in streams.values():
            queue.put_nowait(error)

    async def shutdown(self, message: str = "the server is shutting down") -> None:
        """Fail requests still in flight, stop the loop after its current step, free the engine.

        Safe to call more than once, and from several tasks.
        """
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.ensure_future(self._shutdown(message))
        await asyncio.shield(self._shutdown_task)

    async def _shutdown(self, message: str) -> None:
        if self._loop_task is not None:
            assert self._lock is not None
            async with self._lock:  # never stop the loop mid-step: the engine thread would run on
                self.dead_error = self.dead_error or EngineDeadError(message)
                self._loop_task.cancel()
                self._abort_all()
                self._fail_streams(self.dead_error)
            await asyncio.gather(self._loop_task, return_exceptions=True)
        self.dead_error = self.dead_error or EngineDeadError(message)
        self._executor.shutdown(wait=True)
        # off the loop: stopping tensor-parallel ranks may take seconds, during which the
        # server still answers (503)
        await asyncio.to_thread(self.engine.shutdown)
