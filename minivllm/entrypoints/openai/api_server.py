"""The FastAPI app and its uvicorn server: routes, auth, body limit, graceful shutdown."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import signal
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from minivllm import __version__
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.errors import APIError, error_body, error_response
from minivllm.entrypoints.openai.limits import ServerLimits
from minivllm.entrypoints.openai.middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    JsonOnlyMiddleware,
)
from minivllm.entrypoints.openai.openapi import (
    CHAT_COMPLETION,
    COMPLETION,
    DETOKENIZE,
    TOKENIZE,
    body_route,
    install_openapi,
)
from minivllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    WatermarkDetectRequest,
)
from minivllm.entrypoints.openai.serving_chat import OpenAIServingChat
from minivllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from minivllm.entrypoints.openai.serving_engine import ServerState
from minivllm.entrypoints.openai.serving_scale_out import add_scale_out_routes
from minivllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from minivllm.entrypoints.openai.serving_watermark import OpenAIServingWatermark
from minivllm.metrics import EngineMetrics

logger = logging.getLogger("minivllm")
_OPEN_PATHS = frozenset({"/health", "/metrics"})
DETECT_PATH = "/v1/watermark/detect"


@dataclass(frozen=True)
class ServerConfig:
    """The server's own settings (engine settings live in `EngineArgs`)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_names: tuple[str, ...] = ("model",)
    chat_template: str | None = None
    # reads tool calls from free text (tool_choice "auto"); None: "auto" is refused
    tool_call_parser: str | None = None
    # /metrics repeats each minivllm: series under vLLM's vllm: name
    metrics_vllm_alias: bool = False
    max_request_body_bytes: int = 16 << 20
    limits: ServerLimits = ServerLimits()
    # after SIGINT/SIGTERM: requests in flight get this long to finish while new ones get 503
    shutdown_timeout: float = 10.0
    log_level: str = "info"
    access_log: bool = True
    # refuse requests with "watermarking": false
    watermark_enforce: bool = False
    # leave POST /v1/watermark/detect open without the API key
    watermark_public_detection: bool = False
    # vLLM's scale-out routes: /v1/*/render, /v1/*/derender, /inference/v1/generate
    enable_scale_out: bool = False
    # vLLM's gRPC protocol (docs/grpc.md): instead of HTTP on `port` (as `vllm serve
    # --grpc`), or beside it on `grpc_port` when that is set
    grpc: bool = False
    grpc_port: int | None = None

    def __post_init__(self) -> None:
        if self.grpc_port is not None and not (self.grpc and 0 <= self.grpc_port <= 65535):
            raise ValueError(f"grpc_port needs grpc, and [0, 65535]; got {self.grpc_port}")
        if not self.served_model_names:
            raise ValueError("served_model_names needs at least one name")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_request_body_bytes < 1:
            raise ValueError(
                f"max_request_body_bytes must be >= 1, got {self.max_request_body_bytes}"
            )
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")


def build_app(state: ServerState, metrics: EngineMetrics, config: ServerConfig) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.async_llm.start()
        async with contextlib.AsyncExitStack() as beside:
            if config.grpc_port is not None:  # --grpc --grpc-port: gRPC beside HTTP
                from minivllm.entrypoints.grpc.server import serve_beside_http

                await beside.enter_async_context(serve_beside_http(state, metrics, config))
            yield
        await state.async_llm.shutdown()

    app = FastAPI(title="minivllm", version=__version__, lifespan=lifespan)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_body_bytes)
    app.add_middleware(JsonOnlyMiddleware)
    if config.api_key:
        open_paths = _OPEN_PATHS | ({DETECT_PATH} if config.watermark_public_detection else set())
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key, open_paths=open_paths)
    _add_error_handlers(app)
    _add_routes(app, state, metrics, config.metrics_vllm_alias)
    if config.enable_scale_out:
        add_scale_out_routes(app, state)
    install_openapi(app)
    return app


def _errors(*statuses: int) -> dict[int | str, Any]:
    schema = {"$ref": "#/components/schemas/ErrorResponse"}
    return {
        s: {"description": f"error {s}", "content": {"application/json": {"schema": schema}}}
        for s in statuses
    }


def _add_routes(
    app: FastAPI, state: ServerState, metrics: EngineMetrics, vllm_alias: bool = False
) -> None:
    completions = OpenAIServingCompletion(state)
    chat = OpenAIServingChat(state)
    tokenization = OpenAIServingTokenization(state)
    watermark = OpenAIServingWatermark(state)

    @app.get(
        "/health",
        response_class=Response,
        responses={200: {"description": "serving (no body)"}, **_errors(503)},
    )
    async def health() -> Response:
        if state.is_draining or state.async_llm.dead_error is not None:
            return error_response(
                APIError(503, "the server is shutting down or its engine has stopped")
            )
        return Response(status_code=200)

    @app.get("/version", responses=_errors(401))
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={200: {"content": {"text/plain": {}}}, **_errors(401)},
    )
    async def prometheus_metrics() -> Response:
        body = metrics.render(vllm_alias=vllm_alias)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=_errors(401))
    async def models() -> dict[str, Any]:
        root = state.async_llm.engine.config.model.model
        data = [
            {
                "id": name,
                "object": "model",
                "created": state.created,
                "owned_by": "minivllm",
                "root": root,
                "parent": None,
                "max_model_len": state.max_model_len,
            }
            for name in state.served_model_names
        ]
        return {"object": "list", "data": data}

    body_route(app, "/v1/completions", completions.create, CompletionRequest, True, COMPLETION)
    body_route(
        app, "/v1/chat/completions", chat.create, ChatCompletionRequest, True, CHAT_COMPLETION
    )
    body_route(app, "/tokenize", tokenization.tokenize, TokenizeRequest, answer=TOKENIZE)
    body_route(app, "/detokenize", tokenization.detokenize, DetokenizeRequest, answer=DETOKENIZE)
    body_route(app, DETECT_PATH, watermark.detect, WatermarkDetectRequest)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "HTTP error"
        return JSONResponse(error_body(exc.status_code, message), exc.status_code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(400, "the request is invalid"), 400)  # never echo the input

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(500, f"internal server error ({type(exc).__name__})"), 500)


class _Server(uvicorn.Server):
    """uvicorn, plus: log the URL once listening, and drain the engine on the first SIGINT/SIGTERM."""

    def __init__(
        self, config: uvicorn.Config, state: ServerState, server_config: ServerConfig
    ) -> None:
        super().__init__(config)
        self.state = state
        self.server_config = server_config
        self.loop: asyncio.AbstractEventLoop | None = None
        self.drain_task: concurrent.futures.Future | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started and sockets:
            host, port = sockets[0].getsockname()[:2]
            url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
            logger.info(
                "Serving %s at %s (OpenAI API under %s/v1)", self.state.model_name, url, url
            )

    def handle_exit(self, sig: int, frame: Any) -> None:
        """The first SIGINT/SIGTERM starts the drain and keeps listening (new requests get
        503, so load balancers see the server leave instead of refused connections); a
        second one stops at once, as uvicorn does."""
        if self.drain_task is None and self.loop is not None and not self.should_exit:
            logger.info(
                "Received %s: finishing requests in flight (up to %gs; again to stop now)",
                signal.Signals(sig).name,
                self.server_config.shutdown_timeout,
            )
            self.drain_task = asyncio.run_coroutine_threadsafe(self._drain(), self.loop)
            return
        super().handle_exit(sig, frame)

    async def _drain(self) -> None:
        """Answer 503 to new work; let requests in flight finish for `shutdown_timeout`;
        fail the rest; then let uvicorn close."""
        self.state.is_draining = True
        async_llm = self.state.async_llm
        deadline = time.monotonic() + self.server_config.shutdown_timeout
        try:
            while async_llm.num_active_requests and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if async_llm.num_active_requests:
                logger.warning(
                    "shutdown timeout: failing %d request(s) still in flight",
                    async_llm.num_active_requests,
                )
            await async_llm.shutdown()
        except Exception:
            logger.exception("the drain failed; stopping now")
        finally:
            self.should_exit = True


def bind_socket(host: str, port: int) -> socket.socket:
    """Claim the address before the (slow) model load, so a busy port fails fast."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP;
    # without it every keep-alive response waits ~40 ms on Nagle and delayed ACKs.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def run_server(
    async_llm: AsyncLLM, metrics: EngineMetrics, config: ServerConfig, sock: socket.socket
) -> int:
    """Serve on `sock` (from `bind_socket`) until SIGINT/SIGTERM; returns the process exit status."""
    engine = async_llm.engine
    state = ServerState(
        async_llm=async_llm,
        tokenizer=engine.get_tokenizer(),
        served_model_names=list(config.served_model_names),
        max_model_len=engine.config.scheduler.max_model_len,
        chat_template=config.chat_template,
        tool_call_parser=config.tool_call_parser,
        watermark_enforce=config.watermark_enforce,
        limits=config.limits,
    )
    if config.grpc and config.grpc_port is None:  # as `vllm serve --grpc`: gRPC, no HTTP
        from minivllm.entrypoints.grpc.server import run_grpc_server

        return run_grpc_server(state, metrics, config, sock)
    app = build_app(state, metrics, config)
    uv_config = uvicorn.Config(
        app,
        log_level=config.log_level,
        access_log=config.access_log,
        timeout_keep_alive=5,
        timeout_graceful_shutdown=int(config.shutdown_timeout) + 5,
    )
    server = _Server(uv_config, state, config)
    # uvicorn re-raises the signal that stopped it once it is done; a graceful stop exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        if not async_llm.has_shut_down:  # the app never started, or a forced exit skipped it
            engine.shutdown()
    return 0 if server.started else 1
