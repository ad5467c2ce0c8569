"""Executors run the model runner: in this process, or (later) across TP worker processes."""

from __future__ import annotations

from minivllm.config import EngineConfig
from minivllm.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from minivllm.worker.model_runner import ModelRunner


class InProcessExecutor:
    """The default: one model runner in the engine's own process (tests, `LLM`, a debugger)."""

    def __init__(self, config: EngineConfig) -> None:
        self.runner = ModelRunner(config)

    @property
    def load_seconds(self) -> float:
        return self.runner.load_seconds

    def kv_cache_bytes_per_block(self) -> int:
        return self.runner.kv_cache_bytes_per_block()

    def model_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.runner.model.parameters())

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        pass
