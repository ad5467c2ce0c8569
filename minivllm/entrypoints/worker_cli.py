r"""`minivllm worker`: the tensor-parallel ranks of one more host, with no engine of their own.

    node 0:  minivllm serve MODEL -tp 4 --nnodes 2 --distributed-init-method tcp://10.0.0.1:29500
    node 1:  minivllm worker -tp 4 --nnodes 2 --node-rank 1 \
                 --distributed-init-method tcp://10.0.0.1:29500

(or MASTER_ADDR/MASTER_PORT instead of --distributed-init-method, as torchrun).
Node R runs ranks R*k .. R*k+k-1 (k = tp / nnodes). The engine config (model
path, dtype, ...) comes from node 0, so the model must sit at the same path here.
The command returns when node 0 shuts down (status 0) or a rank fails (status 1).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

from minivllm.entrypoints.log import setup_logging

if TYPE_CHECKING:
    from minivllm.config import ParallelConfig

logger = logging.getLogger("minivllm")


def add_multinode_args(parser: argparse.ArgumentParser) -> None:
    """`--nnodes` and `--distributed-init-method` (EngineArgs fields), for `serve` and `worker`."""
    group = parser.add_argument_group("multi-node tensor parallelism")
    group.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="hosts the tensor-parallel ranks are spread over, evenly (default: %(default)s)",
    )
    group.add_argument(
        "--distributed-init-method",
        default=None,
        metavar="tcp://HOST:PORT",
        help="where the ranks meet: node 0's address and a free port there "
        "(default: $MASTER_ADDR:$MASTER_PORT with several nodes, else loopback and a free port)",
    )


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `worker` on the `minivllm` command's subparsers."""
    parser = subparsers.add_parser(
        "worker",
        help="run this host's tensor-parallel ranks for a driver on node 0 (multi-node)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_worker_args(parser)
    parser.set_defaults(handler=run, parser=parser)
    return parser


def _add_worker_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        required=True,
        help="ranks over all nodes (as given to node 0)",
    )
    parser.add_argument(
        "--node-rank", type=int, required=True, help="this host's index, 1 .. nnodes-1"
    )
    add_multinode_args(parser)


def run(args: argparse.Namespace) -> int:
    from minivllm.config import ParallelConfig
    from minivllm.engine.arg_utils import resolve_init_method

    try:
        parallel = ParallelConfig(
            args.tensor_parallel_size,
            args.nnodes,
            resolve_init_method(args.distributed_init_method, args.nnodes),
        )
        if args.nnodes < 2:
            raise ValueError("`minivllm worker` runs the ranks of nodes 1.. : pass --nnodes >= 2")
        if not 1 <= args.node_rank < args.nnodes:
            raise ValueError(
                f"--node-rank must be in 1..{args.nnodes - 1} (node 0 runs the engine)"
            )
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    return _run_node(parallel, args.node_rank)


def _run_node(parallel: ParallelConfig, node_rank: int) -> int:
    from minivllm.worker.local_workers import LocalWorkers
    from minivllm.worker.worker import node_specs, tp_secret

    init_method = parallel.distributed_init_method
    assert init_method is not None  # ParallelConfig requires it with several nodes
    threads = max(1, len(os.sched_getaffinity(0)) // parallel.ranks_per_node)
    try:
        secret = tp_secret(parallel.nnodes)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    specs = node_specs(parallel, node_rank, init_method, threads, secret)
    logger.info(
        "node %d: ranks %d..%d joining %s", node_rank, specs[0].rank, specs[-1].rank, init_method
    )
    signal.signal(signal.SIGTERM, _raise_interrupt)
    workers = LocalWorkers(specs, None)
    try:
        failure = workers.wait_all()
    except KeyboardInterrupt:
        logger.info("node %d: interrupted, stopping its ranks", node_rank)
        workers.stop(timeout=0.0)
        return 130
    if failure is not None:
        logger.error("%s", failure)
        workers.stop(timeout=0.0)
        return 1
    workers.stop()
    logger.info("node %d: node 0 shut down; exiting", node_rank)
    return 0


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="minivllm worker",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_worker_args(parser)
    args = parser.parse_args(argv)
    setup_logging()
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
