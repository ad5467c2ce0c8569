"""Executors run the model runner: in this process, or across TP worker processes."""

from __future__ import annotations

from typing import Protocol

from minivllm.config import EngineConfig
from minivllm.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from minivllm.worker.model_runner import ModelRunner


class Executor(Protocol):
    """What the engine calls: size and allocate the KV cache, run steps, stop."""

    @property
    def load_seconds(self) -> float: ...
    def kv_cache_budget_bytes(self) -> int: ...
    def kv_cache_bytes_per_block(self) -> int: ...
    def allocate_kv_cache(self, num_blocks: int) -> None: ...
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...
    def shutdown(self) -> None: ...


def make_executor(config: EngineConfig) -> Executor:
    """In-process for one rank; worker processes (`MultiprocExecutor`) for tensor parallelism."""
    if config.parallel.tensor_parallel_size == 1:
        return InProcessExecutor(config)
    from minivllm.worker.multiproc_executor import MultiprocExecutor

    return MultiprocExecutor(config)


class InProcessExecutor:
    """The default: one model runner in the engine's own process (tests, `LLM`, a debugger)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)

    @property
    def load_seconds(self) -> float:
        return self.runner.load_seconds

    def kv_cache_budget_bytes(self) -> int:
        return self.runner.kv_cache_budget_bytes()

    def kv_cache_bytes_per_block(self) -> int:
        return self.runner.kv_cache_bytes_per_block()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.runner.release()
