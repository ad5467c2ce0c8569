r"""`minivllm weight-cache-daemon`: load a model once and keep it for engines to map.

    minivllm weight-cache-daemon MODEL --dtype bfloat16 --max-model-len 4096
    minivllm serve MODEL --dtype bfloat16 --max-model-len 4096 --load-format ipc_cache

The daemon takes serve's engine flags: they must match the engine's (the cache key
compares checkpoint, dtype, max_model_len, kernels, versions, ...), or the engine
loads from disk and says which fields differ. It prints a READY line to stderr once
its socket is bound, and stops (removing its socket) on SIGINT or SIGTERM. With
`-tp N` it runs one process per rank, each serving its own socket, and READY
names them all once every rank serves. Over several nodes, run it on each node with
the engine's `-tp`, `--nnodes`, the node's `--node-rank` and a
`--distributed-init-method` of its own (node 0's address, another port than the
engine's), and the same `$MINIVLLM_TP_SECRET` everywhere:

    node 0:  minivllm weight-cache-daemon MODEL -tp 4 --nnodes 2 --node-rank 0 \
                 --distributed-init-method tcp://10.0.0.1:29600
    node 1:  minivllm weight-cache-daemon MODEL -tp 4 --nnodes 2 --node-rank 1 \
                 --distributed-init-method tcp://10.0.0.1:29600

A rank that dies on any node takes every node's daemon down. With the engine's
`--speculative-config` (draft_model or eagle) it holds the draft as well.
Also: `python -m minivllm.weight_cache MODEL ...`. Details: docs/fast-start.md.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from minivllm.entrypoints.log import setup_logging

logger = logging.getLogger("minivllm")


def _add_args(parser: argparse.ArgumentParser) -> None:
    from minivllm.entrypoints.cli import DEFAULT_MODEL
    from minivllm.entrypoints.engine_flags import add_engine_args

    parser.add_argument(
        "model",
        nargs="?",
        default=DEFAULT_MODEL,
        help=f"checkpoint directory, Hub id or bundled model name (default: {DEFAULT_MODEL})",
    )
    parser.add_argument(
        "--socket-dir",
        metavar="DIR",
        default=None,
        help="directory of the daemon's socket, owned by you (default: "
        "$TMPDIR/minivllm_weight_cache_<uid>, which must be mode 0700)",
    )
    add_engine_args(parser)
    from minivllm.entrypoints.worker_cli import add_multinode_args

    add_multinode_args(parser)
    parser.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="with --nnodes: this host's index, 0 .. nnodes-1 (default: %(default)s)",
    )


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `weight-cache-daemon` on the `minivllm` command's subparsers."""
    parser = subparsers.add_parser(
        "weight-cache-daemon",
        help="keep a loaded model in shared memory for engines to map (--load-format ipc_cache)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_args(parser)
    parser.set_defaults(handler=run, parser=parser)
    return parser


def run(args: argparse.Namespace) -> int:
    from minivllm.entrypoints.engine_flags import engine_args_from
    from minivllm.weight_cache.daemon import run_daemon

    try:
        engine_args = engine_args_from(args)
        if engine_args.load_format != "auto":
            raise ValueError("the daemon loads from the checkpoint: drop --load-format")
        config = engine_args.create_engine_config()
    except (ValueError, TypeError) as exc:
        logger.error("%s", exc)
        return 2
    try:
        return run_daemon(config, args.socket_dir, args.node_rank)
    except (ValueError, RuntimeError, OSError) as exc:
        logger.error("weight cache daemon: %s", exc)
        return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m minivllm.weight_cache",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_args(parser)
    args = parser.parse_args(argv)
    setup_logging()
    return run(args)
