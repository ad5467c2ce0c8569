"""The weight-cache daemon: loads a model once, keeps its final tensors in shared memory,
and hands them to engines on the same host that ask with an equal `WeightCacheKey`.

One process serves one tensor-parallel rank's socket (with tensor_parallel_size > 1,
`daemon_group.py` starts one such process per rank). It builds the model with the
ordinary loader (every post-load step included), copies the tensors into a sealed
memfd (`arena.py`), drops the model, and only then binds its socket, so an engine
that connects earlier is refused and falls back to disk. SIGINT/SIGTERM unlink the
socket and the lock and exit 0; the shared memory goes when the last engine mapping
it exits.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import struct
import time
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from minivllm.distributed.parallel_state import get_tp_size
from minivllm.weight_cache.arena import WeightArena
from minivllm.weight_cache.key import WeightCacheKey, compute_key
from minivllm.weight_cache.process import process_start_time
from minivllm.weight_cache.protocol import (
    COMMANDS,
    MAX_REQUEST_BYTES,
    ProtocolError,
    error_reply,
    recv_message,
    send_message,
)
from minivllm.weight_cache.socket_dir import (
    SocketLock,
    ensure_socket_dir,
    remove_stale_socket,
    socket_path,
)

if TYPE_CHECKING:
    from minivllm.config import EngineConfig

logger = logging.getLogger("minivllm")
_CLIENT_TIMEOUT_S = 10.0  # a client that stalls mid-request is dropped after this
_UCRED = struct.Struct("3i")  # pid, uid, gid


class StopDaemon(Exception):
    """SIGINT or SIGTERM: leave the serving loop and clean up."""


class WeightCacheDaemon:
    """One rank's daemon; with tensor_parallel_size > 1 it runs in a rank process that has
    joined its group (`init_tensor_parallel`), so the loader builds this rank's shard."""

    def __init__(
        self, config: EngineConfig, socket_dir: str | None = None, tp_rank: int = 0
    ) -> None:
        if config.parallel.tensor_parallel_size != get_tp_size():
            raise ValueError(
                "a tensor-parallel weight cache daemon runs one process per rank, each in its "
                "group (run_daemon starts them)"
            )
        if config.device != "cpu":
            raise ValueError(f"the weight cache daemon runs on CPU only (device={config.device})")
        self.tp_rank = tp_rank
        self.socket_dir = ensure_socket_dir(socket_dir)
        self.path = socket_path(self.socket_dir, tp_rank=tp_rank)
        self.lock = SocketLock(self.path)
        self.lock.acquire()  # before the (long) load: a second daemon fails at once
        if remove_stale_socket(self.path):
            logger.info("removed the stale socket of a dead daemon: %s", self.path)
        self.config = config
        self.listener: socket.socket | None = None
        self.arena: WeightArena | None = None
        self.key: WeightCacheKey | None = None
        self.start_time = process_start_time(os.getpid())

    def load(self) -> None:
        from minivllm.kernels.registry import select_kernels
        from minivllm.loader.model_loader import load_model

        start = time.perf_counter()
        config = self.config
        kernels = select_kernels(config.device, config.model.dtype, config.cpu_kernels)
        self.key = compute_key(config, kernels, tp_rank=self.tp_rank)
        # no oneDNN-prepacked bf16 copies (opaque to us: each engine builds its own); the
        # quantized layers' prepacked GEMM copies are ours and held (`QuantizedLinearMethod.hold_packed`)
        model = load_model(config.model, config.device, kernels, available_bytes=None)
        draft = None
        spec = config.speculative_config
        if spec is not None and spec.model:  # the draft an engine with this config runs
            from minivllm.spec_decode.draft_model import draft_model_class, draft_model_config

            draft_config = draft_model_config(spec, config)
            draft = load_model(draft_config, config.device, kernels, None, draft_model_class(spec))
        self.arena = WeightArena(model, draft)
        del model, draft
        logger.info(
            "weight cache: %d tensors (%d aliases), %.2f GiB, loaded in %.1f s",
            len(self.arena.entries),
            len(self.arena.aliases),
            self.arena.size / 2**30,
            time.perf_counter() - start,
        )

    def bind(self) -> None:
        """Listen on the socket (0600); called once the weights are ready."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            listener.bind(self.path)
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)
        listener.listen(16)
        self.listener = listener

    def serve_forever(self, parent: Connection | None = None) -> None:
        """Serve until a signal stops it, or (a rank of a group) until `parent` closes."""
        assert self.listener is not None
        watched: list[Any] = [self.listener] if parent is None else [self.listener, parent]
        while True:
            if parent is not None and parent in wait(watched):
                logger.info("weight cache daemon stopping (its group's parent is gone)")
                return
            conn, _ = self.listener.accept()
            with conn:
                self._serve_one(conn)

    def _serve_one(self, conn: socket.socket) -> None:
        conn.settimeout(_CLIENT_TIMEOUT_S)
        pid, uid, _ = _UCRED.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        )
        if uid != os.getuid():
            logger.warning("refused a weight cache client of uid %d (pid %d)", uid, pid)
            return
        try:
            request, _ = recv_message(conn, MAX_REQUEST_BYTES)
        except (ProtocolError, OSError) as e:
            self._reply(conn, error_reply(f"bad request: {e}"))
            return
        try:
            reply, fds = self.handle(request)
        except Exception as e:  # a bug in one request must not take the daemon down
            logger.exception("weight cache request failed")
            reply, fds = error_reply(f"{type(e).__name__}: {e}"), []
        self._reply(conn, reply, fds)

    def _reply(self, conn: socket.socket, reply: dict[str, Any], fds: list[int] = ()) -> None:
        try:
            send_message(conn, reply, fds)
        except OSError as e:
            logger.warning("could not answer a weight cache client: %s", e)

    def handle(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        cmd = request.get("cmd")
        if cmd not in COMMANDS:
            return error_reply(f"unknown command {cmd!r}; commands: {', '.join(COMMANDS)}"), []
        if cmd == "ping":
            return self._identity(status="ok", released=self.arena is None), []
        if cmd == "release":
            if self.arena is not None:
                self.arena.close()
                self.arena = None
                logger.info("weights released at a client's request")
            return {"status": "ok"}, []
        try:
            key = WeightCacheKey.from_json(request.get("key"))
        except ValueError as e:
            return error_reply(f"bad get_state request: {e}"), []
        assert self.key is not None
        fields = self.key.mismatched_fields(key)
        if fields:
            return {"status": "mismatch", "fields": fields, "daemon_key": self.key.to_json()}, []
        if self.arena is None:
            return error_reply("weights were released"), []
        return self._identity(status="ok", **self.arena.manifest()), [self.arena.fd]

    def _identity(self, **fields: Any) -> dict[str, Any]:
        key = None if self.key is None else self.key.to_json()
        return {**fields, "key": key, "pid": os.getpid(), "start_time": self.start_time}

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        self.lock.release()


def install_stop_handlers() -> None:
    """SIGINT and SIGTERM raise `StopDaemon` in the main thread (also out of a blocking accept)."""
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)


def _stop(signum: int, frame: object) -> None:
    raise StopDaemon(signal.Signals(signum).name)


def run_daemon(config: EngineConfig, socket_dir: str | None = None, node_rank: int = 0) -> int:
    """Load, bind, print the READY banner to fd 2, serve until SIGINT/SIGTERM; exit status.
    With tensor parallelism, this node's ranks (`node_rank` of `nnodes`) as a group."""
    if config.parallel.tensor_parallel_size > 1:
        from minivllm.weight_cache.daemon_group import run_daemon_group

        return run_daemon_group(config, socket_dir, node_rank)
    if node_rank != 0:
        raise ValueError("--node-rank needs tensor parallelism over several nodes (--nnodes)")
    install_stop_handlers()
    daemon = None
    try:
        daemon = WeightCacheDaemon(config, socket_dir)
        daemon.load()
        daemon.bind()
        # straight to fd 2: the banner is what scripts wait for, whatever sys.stderr became
        os.write(2, f"===== Weight cache daemon READY: serving {daemon.path} =====\n".encode())
        daemon.serve_forever()
    except StopDaemon as e:
        logger.info("weight cache daemon stopping (%s)", e)
        return 0
    finally:
        if daemon is not None:
            daemon.close()
    return 0
