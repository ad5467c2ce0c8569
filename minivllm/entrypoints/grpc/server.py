"""The gRPC server on the HTTP server's event loop and `AsyncLLM`: beside HTTP, or instead of it.

`minivllm serve --grpc` does what `vllm serve --grpc` does: the process serves
gRPC, and no HTTP, on `--host`/`--port` (`run_grpc_server`). `--grpc --grpc-port P`
keeps the OpenAI HTTP server on `--port` and serves gRPC on P beside it, from the
same engine in the same event loop (`serve_beside_http`, entered by the HTTP app's
lifespan), so one replica answers both an OpenAI client and a gRPC gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from minivllm.entrypoints.grpc.auth import ApiKeyInterceptor
from minivllm.entrypoints.grpc.servicer import VllmEngineServicer
from minivllm.entrypoints.openai.serving_engine import ServerState
from minivllm.metrics import EngineMetrics

if TYPE_CHECKING:
    from minivllm.entrypoints.openai.api_server import ServerConfig

logger = logging.getLogger("minivllm")
SERVICE_NAME = "vllm.grpc.engine.VllmEngine"
# Open without the API key, as GET /health is.
OPEN_METHODS = (f"/{SERVICE_NAME}/HealthCheck",)
_STOP_GRACE_SECONDS = 1.0  # requests in flight are drained before the server stops


async def start_grpc_server(
    state: ServerState, metrics: EngineMetrics, config: ServerConfig, port: int
) -> grpc.aio.Server:
    """Listen on `config.host`:`port` (0: a free port) and log the address; RuntimeError
    if the address cannot be bound."""
    interceptors = [ApiKeyInterceptor(config.api_key, OPEN_METHODS)] if config.api_key else []
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            # a second server on a busy port must fail, not share it
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", config.max_request_body_bytes),
        ],
    )
    pb_grpc.add_VllmEngineServicer_to_server(VllmEngineServicer(state, metrics), server)
    bound = server.add_insecure_port(_address(config.host, port))
    await server.start()
    logger.info(
        "Serving %s over gRPC (%s) at %s",
        state.model_name,
        SERVICE_NAME,
        _address(config.host, bound),
    )
    return server


@contextlib.asynccontextmanager
async def serve_beside_http(
    state: ServerState, metrics: EngineMetrics, config: ServerConfig
) -> AsyncIterator[None]:
    """gRPC on `config.grpc_port` while the HTTP app runs (its lifespan enters this).

    The HTTP server's drain covers gRPC too: new Generate calls get UNAVAILABLE and
    HealthCheck turns unhealthy while requests in flight, of either protocol, finish.
    """
    assert config.grpc_port is not None
    server = await start_grpc_server(state, metrics, config, config.grpc_port)
    try:
        yield
    finally:
        await server.stop(_STOP_GRACE_SECONDS)


def run_grpc_server(
    state: ServerState, metrics: EngineMetrics, config: ServerConfig, sock: socket.socket
) -> int:
    """Serve gRPC, and no HTTP, on the port `sock` claimed, until SIGINT/SIGTERM; returns
    the exit status (0 after a graceful stop)."""
    port = sock.getsockname()[1]
    sock.close()  # gRPC binds the port itself: the socket only held it while the model loaded
    try:
        return asyncio.run(_serve(state, metrics, config, port))
    finally:
        if not state.async_llm.has_shut_down:
            state.async_llm.engine.shutdown()


async def _serve(
    state: ServerState, metrics: EngineMetrics, config: ServerConfig, port: int
) -> int:
    """Serve until the first signal; then drain: refuse new work and let requests in
    flight finish for `shutdown_timeout` seconds (a second signal ends that early)."""
    async_llm = state.async_llm
    async_llm.start()
    try:
        server = await start_grpc_server(state, metrics, config, port)
    except RuntimeError as exc:
        logger.error("cannot listen on %s for gRPC: %s", _address(config.host, port), exc)
        await async_llm.shutdown()
        return 1
    signals: asyncio.Queue[int] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    received = await signals.get()
    logger.info(
        "Received %s: finishing requests in flight (up to %gs; again to stop now)",
        signal.Signals(received).name,
        config.shutdown_timeout,
    )
    state.is_draining = True
    drained = asyncio.ensure_future(_wait_idle(state, config.shutdown_timeout))
    second = asyncio.ensure_future(signals.get())
    await asyncio.wait({drained, second}, return_when=asyncio.FIRST_COMPLETED)
    drained.cancel()
    second.cancel()
    if async_llm.num_active_requests:
        logger.warning(
            "shutdown: failing %d request(s) still in flight", async_llm.num_active_requests
        )
    await async_llm.shutdown()
    await server.stop(_STOP_GRACE_SECONDS)
    return 0


async def _wait_idle(state: ServerState, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while state.async_llm.num_active_requests and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
