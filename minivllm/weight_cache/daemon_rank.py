"""One rank of a tensor-parallel weight-cache daemon: `python -m minivllm.weight_cache.daemon_rank FD`.

Started by `daemon_group.py`; FD is this rank's end of a socket pair to the group's
parent, whose first message is the `RankSpec`, the engine config and the socket
directory. The rank joins the group exactly as an engine rank does
(`init_tensor_parallel`), so the ordinary loader builds this rank's shard; it then
serves its own socket (`..._tp<rank>.sock`) and tells the parent `("ready", path)`.
It stops on SIGINT/SIGTERM or when the parent's end closes (the parent died),
removing its socket and lock either way; a failure goes to the parent as
`("error", traceback)`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection

logger = logging.getLogger("minivllm")


@dataclass(frozen=True, slots=True)
class RankSpec:
    rank: int
    world_size: int
    init_method: str  # tcp://host:port: loopback on one node, node 0's address over several
    num_threads: int
    log_level: int = logging.INFO
    secret: bytes = field(default=b"", repr=False)  # seals the group's control plane
    watch_group: bool = False  # several nodes: meet the other ranks in a barrier while serving


WATCH_INTERVAL_S = 2.0
HEARTBEAT_TIMEOUT_S = 60.0


def run_rank(conn: Connection) -> int:
    """The rank process's body; returns its exit status."""
    from minivllm.weight_cache.daemon import StopDaemon, WeightCacheDaemon, install_stop_handlers

    spec, config, socket_dir = conn.recv()
    install_stop_handlers()
    _setup_logging(spec)
    daemon = None
    try:
        import torch

        from minivllm.distributed.parallel_state import init_tensor_parallel

        torch.set_num_threads(spec.num_threads)
        init_tensor_parallel(spec.rank, spec.world_size, spec.init_method, spec.secret)
        # (collective: every rank of every node makes it, before anything can fail apart)
        heartbeat = _heartbeat_group() if spec.watch_group else None
        daemon = WeightCacheDaemon(config, socket_dir, tp_rank=spec.rank)
        daemon.load()
        daemon.bind()
        conn.send(("ready", daemon.path))
        if heartbeat is not None:
            watch = threading.Thread(target=_watch_group, args=(spec, conn, heartbeat), daemon=True)
            watch.start()
        daemon.serve_forever(parent=conn)
    except StopDaemon as e:
        logger.info("weight cache daemon rank %d stopping (%s)", spec.rank, e)
    except Exception:  # noqa: BLE001 - every failure goes to the parent, with its traceback
        text = traceback.format_exc()
        try:
            conn.send(("error", text))
        except OSError:
            logger.error("weight cache daemon rank %d failed:\n%s", spec.rank, text)
        return 1
    finally:
        # the parent's SIGTERM often follows our own stop: it must not cut the cleanup short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if daemon is not None:
            daemon.close()
    return 0


def _heartbeat_group():
    """A gloo group over the same ranks whose collectives give up after
    HEARTBEAT_TIMEOUT_S (the world group never does): a node that vanishes without
    closing its connections (power, network) then fails the barrier too."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=timedelta(seconds=HEARTBEAT_TIMEOUT_S))


def _watch_group(spec: RankSpec, conn: Connection, heartbeat) -> None:
    """Wait (without a deadline: loads take as long as they take) until every rank of
    every node serves, then meet them all in a barrier every WATCH_INTERVAL_S; when it
    fails (a rank elsewhere died or stopped: gloo sees its connections close, or the
    barrier times out), tell the parent, which takes this node's group down, and stop
    this rank (SIGTERM: its socket and lock are removed as on any stop)."""
    import torch.distributed as dist

    try:
        dist.barrier()  # the world group: all loaded
        while True:
            dist.barrier(group=heartbeat)
            time.sleep(WATCH_INTERVAL_S)
    except Exception as e:  # noqa: BLE001 - whatever gloo raises, the group is broken
        why = f"lost the daemon group (another node's rank stopped or died): {e}"
        try:
            conn.send(("error", why))
        except OSError:
            logger.error("weight cache daemon rank %d %s", spec.rank, why)
        os.kill(os.getpid(), signal.SIGTERM)


def _setup_logging(spec: RankSpec) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s %(levelname)s minivllm weight cache rank {spec.rank}: %(message)s",
            "%H:%M:%S",
        )
    )
    logger.addHandler(handler)
    logger.setLevel(spec.log_level)
    logger.propagate = False


if __name__ == "__main__":
    status = run_rank(Connection(int(sys.argv[1])))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # skip the interpreter's slow teardown of torch.distributed
