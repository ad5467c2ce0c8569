"""Tensor parallelism: the model split over N ranks in worker processes, on one host or several.

The engine (scheduler, output processor) stays in this, the driver, process and
calls the executor exactly as it calls `InProcessExecutor`. This host's ranks
(0..k-1, k = tensor_parallel_size / nnodes) are child processes; the ranks of
other hosts come from `minivllm worker --node-rank R` there. Every call goes to
rank 0, which relays it to all ranks over torch.distributed; every rank runs it
(`execute_model`: forward, all-reduces, logits all-gather, sampling, and rank
0's sampled tokens broadcast so all ranks continue from the same ones); rank
0's result comes back.
"""

from __future__ import annotations

import logging
import socket
import weakref
from typing import Any

import torch

from minivllm.config import EngineConfig
from minivllm.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from minivllm.worker.local_workers import LocalWorkers, WorkerError
from minivllm.worker.worker import node_specs, tp_secret

logger = logging.getLogger("minivllm")


class MultiprocExecutor:
    """Drive `tensor_parallel_size` ranks; a failed or dead rank raises `WorkerError`."""

    def __init__(self, config: EngineConfig) -> None:
        parallel = config.parallel
        init_method = parallel.distributed_init_method or f"tcp://127.0.0.1:{free_port()}"
        threads = max(1, torch.get_num_threads() // parallel.ranks_per_node)
        specs = node_specs(parallel, 0, init_method, threads, tp_secret(parallel.nnodes))
        if parallel.nnodes > 1:
            logger.info(
                "waiting for %d more node(s) to join at %s (`minivllm worker` there)",
                parallel.nnodes - 1,
                init_method,
            )
        self.nnodes = parallel.nnodes
        self.workers = LocalWorkers(specs, config)
        self._error: WorkerError | None = None
        self._finalizer = weakref.finalize(self, _stop, self.workers)
        self.load_seconds: float = self._call("load_seconds")

    @property
    def worker_pids(self) -> list[int]:
        """This host's ranks, rank 0 first."""
        return self.workers.pids

    def kv_cache_budget_bytes(self) -> int:
        return self._call("kv_cache_budget_bytes")

    def kv_cache_bytes_per_block(self) -> int:
        return self._call("kv_cache_bytes_per_block")

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._call("allocate_kv_cache", num_blocks)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._call("execute_model", scheduler_output)

    def shutdown(self) -> None:
        """Stop every rank (remote ones too: rank 0 relays the stop); safe to call twice."""
        self._finalizer()

    def _call(self, method: str, *args: Any) -> Any:
        if self._error is not None:
            raise WorkerError(f"the tensor-parallel workers are gone after:\n{self._error}")
        try:
            self.workers.send(0, (method, args))
            return self.workers.receive(0)
        except WorkerError as exc:
            if self.nnodes > 1:
                exc = WorkerError(
                    f"{exc}\n(ranks on other nodes log theirs: see `minivllm worker`)"
                )
            self._fail(exc)
            raise exc from None
        except BaseException as exc:  # Ctrl-C mid-step: the ranks' state is now unknown
            self._fail(WorkerError(f"interrupted during {method}: {exc!r}"))
            raise

    def _fail(self, error: WorkerError) -> None:
        self._error = error
        self._finalizer.detach()
        self.workers.stop(timeout=0.0)


def _stop(workers: LocalWorkers) -> None:
    try:
        workers.send(0, None)  # rank 0 relays: every rank leaves its loop and exits
    except WorkerError:
        pass
    workers.stop()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on `host` (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
