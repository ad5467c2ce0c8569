"""One tensor-parallel rank in its own process: join the group, build a model runner, serve calls.

    driver (LLMEngine)                 rank 0               ranks 1..N-1 (this host or others)
    MultiprocExecutor ──pipe──► recv (method, args) ──cpu_group broadcast──► same call
                      ◄─pipe─── rank 0's result      activations meet over device_group

Started as `python -m minivllm.worker FD` by `LocalWorkers`; FD is this
rank's end of a socket pair to its parent. The first message on it is the
`WorkerSpec` (plus the engine config, for rank 0); rank 0's config reaches
every other rank over the cpu group, so a headless node needs no model flags.
Only rank 0 answers calls; any rank that fails sends `("error", WorkerFailure)`
to its parent and exits.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import torch

from minivllm.config import EngineConfig, ParallelConfig
from minivllm.distributed.parallel_state import (
    all_reduce_min,
    broadcast_object,
    destroy_tensor_parallel,
    get_tp_rank,
    init_device_group,
    init_tensor_parallel,
)
from minivllm.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from minivllm.worker.model_runner import ModelRunner

logger = logging.getLogger("minivllm")


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    rank: int
    world_size: int
    local_rank: int  # index among this host's ranks: its CUDA device
    ranks_per_node: int
    init_method: str  # tcp://host:port of node 0
    num_threads: int
    log_level: int = logging.WARNING
    secret: bytes = field(default=b"", repr=False)  # seals the control plane's messages


TP_SECRET_ENV = "MINIVLLM_TP_SECRET"


def tp_secret(nnodes: int) -> bytes:
    """The key that seals the control plane: random for one node (its ranks get it over
    their private socket pairs); with several, every node's `$MINIVLLM_TP_SECRET`."""
    if nnodes == 1:
        return secrets.token_bytes(32)
    shared = os.environ.get(TP_SECRET_ENV, "")
    if len(shared) < 16:
        raise ValueError(
            f"tensor parallelism over several nodes needs the same secret on every node: "
            f"set {TP_SECRET_ENV} (at least 16 characters, e.g. the output of "
            "`python -c 'import secrets; print(secrets.token_hex(32))'`) before "
            "`minivllm serve` and each `minivllm worker` (docs/tensor-parallel.md)"
        )
    return hashlib.sha256(shared.encode()).digest()


def node_specs(
    parallel: ParallelConfig, node_rank: int, init_method: str, num_threads: int, secret: bytes
) -> list[WorkerSpec]:
    """The ranks node `node_rank` runs: `ranks_per_node` consecutive ones, local ranks from 0."""
    local = parallel.ranks_per_node
    return [
        WorkerSpec(
            rank=node_rank * local + i,
            world_size=parallel.tensor_parallel_size,
            local_rank=i,
            ranks_per_node=local,
            init_method=init_method,
            num_threads=num_threads,
            log_level=logger.getEffectiveLevel(),
            secret=secret,
        )
        for i in range(local)
    ]


@dataclass(frozen=True, slots=True)
class WorkerFailure:
    """What a failed rank tells its parent: where, when, and the traceback."""

    rank: int
    pid: int
    time: float
    traceback: str


class Worker:
    """A model runner whose collectives reach the other ranks. Methods are the driver's calls."""

    def __init__(self, config: EngineConfig, spec: WorkerSpec) -> None:
        if config.device == "cuda":
            torch.cuda.set_device(spec.local_rank)
        init_device_group(config.device)
        self.config, self.spec = config, spec
        self.runner = ModelRunner(config)

    def load_seconds(self) -> float:
        return self.runner.load_seconds

    def kv_cache_budget_bytes(self) -> int:
        """This rank's budget; every rank agrees on the smallest (the driver sizes one pool)."""
        return all_reduce_min(self.runner.kv_cache_budget_bytes(self._ram_sharers()))

    def kv_cache_bytes_per_block(self) -> int:
        return self.runner.kv_cache_bytes_per_block()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def _ram_sharers(self) -> int:
        return self.spec.ranks_per_node if self.config.device == "cpu" else 1

    def serve(self, conn: Connection) -> None:
        """Run calls until the driver stops (or goes away); rank 0 reads them and relays them."""
        is_driver_link = get_tp_rank() == 0
        while True:
            call = _receive_call(conn) if is_driver_link else None
            call = broadcast_object(call)
            if call is None:
                return
            method, args = call
            result = getattr(self, method)(*args)
            if is_driver_link and not _reply(conn, result):
                broadcast_object(None)  # the driver went away mid-call: stop every rank
                return


def _receive_call(conn: Connection) -> tuple[str, tuple] | None:
    try:
        return conn.recv()
    except (EOFError, OSError):  # the driver is gone: stop every rank
        return None


def _reply(conn: Connection, result: object) -> bool:
    try:
        conn.send(("ok", result))
    except OSError:
        return False
    return True


def run_worker(conn: Connection) -> int:
    """The process body; returns the exit status."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the driver, which stops us
    # Every rank unpickles an EngineConfig, which holds transformers' config object: rank 0
    # from the parent's message, the others from rank 0's broadcast once the group has
    # formed. Importing transformers' config classes first (~2 s on a Zen 1 core) lets the
    # ranks do it side by side; before, the other ranks' import began only after rank 0's
    # was done, and a TP=2 engine took ~1.8 s longer to start on 2 cores.
    try:
        import transformers.models.auto.configuration_auto  # noqa: F401
    except ImportError:
        pass  # then unpickling the config below fails, and says why

    spec, config = conn.recv()
    _setup_logging(spec)
    try:
        torch.set_num_threads(spec.num_threads)
        init_tensor_parallel(spec.rank, spec.world_size, spec.init_method, spec.secret)
        config = broadcast_object(config)
        Worker(config, spec).serve(conn)
    except Exception:  # noqa: BLE001 - every failure goes to the parent, with its traceback
        text = traceback.format_exc()
        try:  # the parent reports it (a driver raises it, a headless node logs it)
            conn.send(("error", WorkerFailure(spec.rank, os.getpid(), time.time(), text)))
        except OSError:
            logger.error("rank %d failed:\n%s", spec.rank, text)
        return 1
    destroy_tensor_parallel()
    return 0


def _setup_logging(spec: WorkerSpec) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s %(levelname)s minivllm rank {spec.rank}: %(message)s", "%H:%M:%S"
        )
    )
    logger.addHandler(handler)
    logger.setLevel(spec.log_level)
    logger.propagate = False
