"""AsyncLLM in process: batching, idling, and what a failed step does to requests."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

MAX_MODEL_LEN = 256


@pytest.fixture
def engine(qwen3_dir: Path) -> Any:
    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.engine.llm_engine import LLMEngine

    args = EngineArgs(
        str(qwen3_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=1 << 20
    )
    return LLMEngine.from_engine_args(args)


def _run_async_llm(engine: Any, body: Any) -> Any:
    """Run `body(async_llm)` on a fresh AsyncLLM over `engine`, then shut it down."""
    from minivllm.engine.async_llm import AsyncLLM
    from minivllm.metrics import EngineMetrics

    async def main() -> Any:
        async_llm = AsyncLLM(engine, EngineMetrics("test"))
        async_llm.start()
        try:
            return await body(async_llm)
        finally:
            await async_llm.shutdown()

    return asyncio.run(main())


def test_async_llm_batches_concurrent_requests_and_idles(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from minivllm import SamplingParams

    batch_sizes: list[int] = []
    step = engine.step

    def counting_step() -> Any:
        batch_sizes.append(engine.stats().num_running + engine.stats().num_waiting)
        return step()

    monkeypatch.setattr(engine, "step", counting_step)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def body(async_llm: Any) -> list[list[int]]:
        async def one(i: int) -> list[int]:
            ids: list[int] = []
            async for out in async_llm.generate(
                {"prompt_token_ids": [5 + i, 6, 7]}, params, f"r{i}"
            ):
                ids.extend(out.outputs[0].token_ids)
            return ids

        results = await asyncio.gather(*(one(i) for i in range(8)))
        num_steps = len(batch_sizes)
        await asyncio.sleep(0.2)  # idle: the loop waits on its event and does not step
        assert len(batch_sizes) == num_steps
        return results

    results = _run_async_llm(engine, body)
    assert all(len(ids) == 6 for ids in results)
    assert max(batch_sizes) == 8  # all eight clients shared steps
    assert not engine.has_unfinished_requests()


def test_async_llm_step_failure_fails_requests_then_recovers(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from minivllm import SamplingParams
    from minivllm.engine.async_llm import EngineStepError

    step = engine.step
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def broken_step() -> Any:
        raise RuntimeError("boom")

    async def body(async_llm: Any) -> list[int]:
        monkeypatch.setattr(engine, "step", broken_step)
        with pytest.raises(EngineStepError):
            async for _ in async_llm.generate({"prompt_token_ids": [5, 6, 7]}, params, "bad"):
                pass
        assert not engine.has_unfinished_requests() and async_llm.dead_error is None
        monkeypatch.setattr(engine, "step", step)
        ids: list[int] = []
        async for out in async_llm.generate({"prompt_token_ids": [5, 6, 7]}, params, "good"):
            ids.extend(out.outputs[0].token_ids)
        return ids

    assert len(_run_async_llm(engine, body)) == 4
    assert engine.kv_cache_manager.usage == 0.0


def test_a_failing_request_fails_alone_and_the_others_finish_unchanged(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that raises because of one request (here: any step holding the request
    with seed 666) fails that request only; the others, batched with it, are rerun and
    give the tokens they give without it (greedy: an independent run is the oracle)."""
    from minivllm import SamplingParams
    from minivllm.engine.async_llm import EngineStepError
    from minivllm.worker.input_batch import InputBatch

    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    poison = SamplingParams(temperature=1.0, seed=666, max_tokens=6, ignore_eos=True)
    prompts = [[5 + i, 6, 7, 8] for i in range(4)]

    async def run_all(async_llm: Any, with_poison: bool) -> list[Any]:
        async def one(rid: str, prompt: list[int], params: Any) -> Any:
            ids: list[int] = []
            try:
                async for out in async_llm.generate({"prompt_token_ids": prompt}, params, rid):
                    ids.extend(out.outputs[0].token_ids)
            except EngineStepError as exc:
                return exc
            return ids

        jobs = [one(f"g{i}-{with_poison}", p, greedy) for i, p in enumerate(prompts)]
        if with_poison:
            jobs.insert(2, one("poison", [9, 10, 11], poison))
        return await asyncio.gather(*jobs)

    add = InputBatch.add

    def failing_add(self: Any, state: Any) -> None:
        if state.sampling_params.seed == 666:
            raise OverflowError("a value this request carries does not fit")
        add(self, state)

    async def body(async_llm: Any) -> tuple[list[Any], list[Any]]:
        expected = await run_all(async_llm, with_poison=False)
        monkeypatch.setattr(InputBatch, "add", failing_add)
        return expected, await run_all(async_llm, with_poison=True)

    expected, got = _run_async_llm(engine, body)
    assert isinstance(got.pop(2), EngineStepError)
    assert got == expected and all(len(ids) == 6 for ids in expected)
    assert not engine.has_unfinished_requests() and not engine.scheduler.isolating
    assert engine.kv_cache_manager.usage == 0.0


def test_async_llm_dead_tensor_parallel_worker_is_fatal(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lost rank stops the engine, and its loop ends: no step is retried (a dead
    tensor-parallel engine once spun writing ~4 MB/s of tracebacks)."""
    from minivllm import SamplingParams
    from minivllm.engine.async_llm import EngineDeadError
    from minivllm.worker.local_workers import WorkerError

    calls = []

    def dead_worker_step() -> Any:
        calls.append(1)
        raise WorkerError("rank 1 (pid 1234) was killed by SIGKILL")

    monkeypatch.setattr(engine, "step", dead_worker_step)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def body(async_llm: Any) -> None:
        with pytest.raises(EngineDeadError):
            async for _ in async_llm.generate({"prompt_token_ids": [5, 6, 7]}, params, "a"):
                pass
        assert async_llm.dead_error is not None
        await asyncio.sleep(0.2)
        assert async_llm._loop_task.done() and len(calls) == 1
        with pytest.raises(EngineDeadError):  # later requests are refused at once
            await async_llm.add_request({"prompt_token_ids": [5, 6]}, params, "b")

    _run_async_llm(engine, body)


def test_engine_is_built_and_stepped_on_one_thread(
    qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One thread runs all torch work, so the process has one OpenMP team (see from_engine_args)."""
    import threading

    from minivllm import SamplingParams
    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.engine.async_llm import AsyncLLM
    from minivllm.engine.llm_engine import LLMEngine

    threads: dict[str, set[int]] = {"build": set(), "step": set()}
    build, step = LLMEngine.from_engine_args.__func__, LLMEngine.step

    def recording_build(cls: type, args: EngineArgs) -> LLMEngine:
        threads["build"].add(threading.get_ident())
        return build(cls, args)

    def recording_step(self: LLMEngine) -> Any:
        threads["step"].add(threading.get_ident())
        return step(self)

    monkeypatch.setattr(LLMEngine, "from_engine_args", classmethod(recording_build))
    monkeypatch.setattr(LLMEngine, "step", recording_step)
    args = EngineArgs(str(qwen3_dir), dtype="float32", max_model_len=MAX_MODEL_LEN)
    async_llm = AsyncLLM.from_engine_args(args)

    async def main() -> None:
        async_llm.start()
        try:
            params = SamplingParams(max_tokens=3, ignore_eos=True)
            async for _ in async_llm.generate({"prompt_token_ids": [5, 6, 7]}, params, "r"):
                pass
        finally:
            await async_llm.shutdown()

    asyncio.run(main())
    assert len(threads["build"]) == 1 and threads["build"] == threads["step"]
    assert threading.get_ident() not in threads["build"]


def test_request_ids_cannot_collide_with_another_request_s_children(engine: Any) -> None:
    """`x` with n=2 has children `0_x` and `1_x`; a request named `0_x` would share the
    scheduler's entry (a KeyError in every later step, once)."""
    from minivllm import SamplingParams

    engine.add_request("x", {"prompt_token_ids": [5, 6]}, SamplingParams(n=2, max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("0_x", {"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2))
    engine.add_request("y", {"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("y", {"prompt_token_ids": [7]}, SamplingParams(n=2, max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()


def test_a_scheduler_failure_stops_the_engine(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure inside the scheduler is no request's fault and leaves its state unknown:
    the engine stops (health turns 503) instead of failing request after request."""
    from minivllm import SamplingParams
    from minivllm.engine.async_llm import EngineDeadError

    def broken_schedule() -> Any:
        raise KeyError("corrupt scheduler state")

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def body(async_llm: Any) -> None:
        monkeypatch.setattr(engine.scheduler, "schedule", broken_schedule)
        with pytest.raises(EngineDeadError):
            async for _ in async_llm.generate({"prompt_token_ids": [5, 6, 7]}, params, "a"):
                pass
        assert async_llm.dead_error is not None

    _run_async_llm(engine, body)
