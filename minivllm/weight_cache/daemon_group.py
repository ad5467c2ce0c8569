"""A tensor-parallel weight-cache daemon: one process per rank, supervised by this one.

    daemon parent (this)  ──socket pair──►  rank 0: join group, load shard, serve ..._tp0.sock
                          ──socket pair──►  rank 1: join group, load shard, serve ..._tp1.sock
                          ◄── ("ready", socket path) from each, then silence

The ranks meet over torch.distributed exactly as an engine's do (one node, loopback,
a random control-plane secret), so each builds its shard with the ordinary loader.
The parent prints READY once every rank serves. A rank that fails or dies takes the
group down: the others are stopped and the parent exits 1. SIGINT/SIGTERM stop every
rank (each removes its socket and lock) and exit 0; if the parent itself is killed,
each rank sees its socket pair close and stops the same way.

Over several nodes (`--nnodes N --node-rank R --distributed-init-method tcp://node0:port`,
the same `$MINIVLLM_TP_SECRET` on every node, as for `minivllm worker`) each node runs
this supervisor for its own ranks (R*k .. R*k+k-1, k = tp / nnodes), and the ranks of all
nodes join one group. No parent sees the other nodes' ranks, so once serving every rank
keeps meeting the others in a gloo barrier every few seconds: a rank that dies anywhere
closes its connections, the barrier fails at once on every other rank, and each node's
group goes down as if one of its own ranks had died.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING

from minivllm.weight_cache.daemon import StopDaemon, install_stop_handlers
from minivllm.weight_cache.daemon_rank import RankSpec

if TYPE_CHECKING:
    from minivllm.config import EngineConfig

logger = logging.getLogger("minivllm")
_STOP_GRACE_S = 10.0  # a rank asked to stop gets this long before SIGKILL


class RankFailedError(RuntimeError):
    """A rank of the daemon group failed or died; the group is stopped."""


@dataclass(slots=True, eq=False)
class _Rank:
    rank: int
    proc: subprocess.Popen
    conn: Connection

    def describe_exit(self) -> str:
        try:
            code = self.proc.wait(1.0)
        except subprocess.TimeoutExpired:
            return "closed its pipe but still runs"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with status {code}"


def run_daemon_group(config: EngineConfig, socket_dir: str | None, node_rank: int = 0) -> int:
    """Start a rank process per TP rank of this node, print READY when all serve,
    supervise; exit status."""
    import torch

    from minivllm.worker.multiproc_executor import free_port
    from minivllm.worker.worker import tp_secret

    parallel = config.parallel
    nnodes, size, local = parallel.nnodes, parallel.tensor_parallel_size, parallel.ranks_per_node
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank {node_rank} is not in 0 .. {nnodes - 1} (nnodes={nnodes})")
    if nnodes == 1:
        init_method = f"tcp://127.0.0.1:{free_port()}"
    else:
        init_method = parallel.distributed_init_method  # node 0's; checked by ParallelConfig
    secret = tp_secret(nnodes)  # several nodes: $MINIVLLM_TP_SECRET, or a clear error
    threads = max(1, torch.get_num_threads() // local)
    install_stop_handlers()
    ranks: list[_Rank] = []
    try:
        for r in range(node_rank * local, (node_rank + 1) * local):
            spec = RankSpec(
                r, size, init_method, threads, logger.getEffectiveLevel(), secret, nnodes > 1
            )
            ranks.append(_start(spec, config, socket_dir))
        paths = _wait_all_ready(ranks)
        banner = f"===== Weight cache daemon READY: serving {', '.join(paths)} ====="
        where = f", node {node_rank} of {nnodes}" if nnodes > 1 else ""
        os.write(2, f"{banner} (tensor_parallel_size={size}{where})\n".encode())
        ready = wait([r.conn for r in ranks])  # a rank says nothing more unless it fails
        raise _failure(ranks, *_last_word(next(r for r in ranks if r.conn in ready)))
    except StopDaemon as e:
        logger.info("weight cache daemon group stopping (%s)", e)
        return 0
    except RankFailedError as e:
        logger.error("%s", e)
        return 1
    finally:
        _stop_all(ranks)


def _start(spec: RankSpec, config: EngineConfig, socket_dir: str | None) -> _Rank:
    from minivllm.worker.local_workers import spawn_child

    proc, conn = spawn_child("minivllm.weight_cache.daemon_rank")
    rank = _Rank(spec.rank, proc, conn)
    try:
        rank.conn.send((spec, config, socket_dir))
    except OSError:
        pass  # it died at once: _wait_all_ready reports it
    return rank


def _wait_all_ready(ranks: list[_Rank]) -> list[str]:
    """Every rank's socket path, in rank order, once all serve; a rank failing raises."""
    paths: dict[int, str] = {}
    while len(paths) < len(ranks):
        for conn in wait([r.conn for r in ranks if r.rank not in paths]):
            rank = next(r for r in ranks if r.conn is conn)
            try:
                kind, value = conn.recv()
            except (EOFError, OSError):
                raise _failure(ranks, rank, rank.describe_exit()) from None
            if kind != "ready":
                raise _failure(ranks, rank, f"failed:\n{value}")
            paths[rank.rank] = value
    return [paths[r.rank] for r in ranks]


def _failure(ranks: list[_Rank], rank: _Rank, what: str) -> RankFailedError:
    return RankFailedError(
        f"weight cache daemon rank {rank.rank} (pid {rank.proc.pid}) {what}; "
        f"stopping the other {len(ranks) - 1} rank(s)"
    )


def _last_word(rank: _Rank) -> tuple[_Rank, str]:
    """A serving rank that spoke: its traceback, or how it exited."""
    try:
        kind, value = rank.conn.recv()
    except (EOFError, OSError):
        return rank, rank.describe_exit()
    return rank, f"failed:\n{value}" if kind == "error" else f"sent {kind!r}"


def _stop_all(ranks: list[_Rank]) -> None:
    """SIGTERM every live rank (each removes its socket and lock), SIGKILL a stuck one."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut this short
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for r in ranks:
        if r.proc.poll() is None:
            r.proc.terminate()
    for r in ranks:
        try:
            r.proc.wait(_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            logger.warning("weight cache daemon rank %d did not stop; killing it", r.rank)
            r.proc.kill()
            r.proc.wait()
        r.conn.close()
