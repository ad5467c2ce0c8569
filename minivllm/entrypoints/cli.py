"""The `minivllm` command: `minivllm serve MODEL [flags]` (vLLM's flag names where vLLM has one)."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from typing import TYPE_CHECKING

from minivllm import __version__
from minivllm.entrypoints import watermark_cli, weight_cache_cli, worker_cli
from minivllm.entrypoints.engine_flags import add_engine_args, byte_size, engine_args_from
from minivllm.entrypoints.log import setup_logging
from minivllm.entrypoints.openai.limits import add_limit_args, limits_from

if TYPE_CHECKING:
    from minivllm.engine.async_llm import AsyncLLM

logger = logging.getLogger("minivllm")
_API_KEY_ENV = "MINIVLLM_API_KEY"
DEFAULT_MODEL = "demo-base"  # bundled, so `minivllm serve` works offline on a fresh machine


def add_server_args(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: %(default)s)"
    )
    server.add_argument(
        "--port",
        type=int,
        default=8000,
        help="port to listen on; 0 picks a free one (default: %(default)s)",
    )
    server.add_argument(
        "--grpc",
        action="store_true",
        help="serve vLLM's gRPC protocol (the VllmEngine service) instead of HTTP, on --port, "
        "as `vllm serve --grpc` does; with --grpc-port, beside HTTP (docs/grpc.md)",
    )
    server.add_argument(
        "--grpc-port",
        metavar="PORT",
        type=int,
        default=None,
        help="with --grpc: serve gRPC on this port and keep HTTP on --port; 0 picks a free one",
    )
    server.add_argument(
        "--api-key",
        metavar="KEY",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on every route but /health and /metrics "
        f"(default: ${_API_KEY_ENV} if set, else no key)",
    )
    server.add_argument(
        "--served-model-name",
        metavar="NAME",
        nargs="+",
        default=None,
        help="name(s) clients use in 'model'; the first is reported (default: the model path)",
    )
    server.add_argument(
        "--chat-template",
        metavar="FILE",
        default=None,
        help="a Jinja chat template file (or the template itself) instead of the tokenizer's",
    )
    server.add_argument(
        "--metrics-vllm-alias",
        action="store_true",
        help="/metrics also reports every minivllm: series under vLLM's vllm: name "
        "(for dashboards built on vLLM)",
    )
    server.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser',
    )
    server.add_argument(
        "--tool-call-parser",
        choices=["hermes"],
        default=None,
        help="how tool calls are read from the model's text: hermes (<tool_call>{...}</tool_call>, "
        "Hermes and Qwen chat templates)",
    )
    server.add_argument(
        "--max-request-body-bytes",
        metavar="BYTES",
        type=byte_size,
        default=16 << 20,
        help="larger request bodies get 413 (default: 16MiB)",
    )
    server.add_argument(
        "--shutdown-timeout",
        metavar="SECONDS",
        type=float,
        default=10.0,
        help="seconds requests in flight may take to finish after SIGINT/SIGTERM, "
        "before they are failed (default: %(default)s)",
    )
    server.add_argument(
        "--uvicorn-log-level",
        metavar="LEVEL",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level: critical, error, warning, info, debug or trace (default: %(default)s)",
    )
    server.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="do not log one line per HTTP request",
    )
    server.add_argument(
        "--watermark-enforce",
        action="store_true",
        help="refuse requests that opt out of the watermark ('watermarking': false) with a 400",
    )
    server.add_argument(
        "--watermark-public-detection",
        action="store_true",
        help="leave POST /v1/watermark/detect open without the API key (everything else "
        "still needs it): the public may check texts but not generate",
    )
    server.add_argument(
        "--enable-scale-out",
        action="store_true",
        help="add vLLM's scale-out routes: POST /v1/completions/render, "
        "/v1/chat/completions/render (tokenize only), /inference/v1/generate (token ids in "
        "and out) and the matching /derender routes (docs/scale-out.md)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minivllm",
        description="minivllm: a compact LLM inference engine with vLLM's interface.",
    )
    parser.add_argument("--version", action="version", version=f"minivllm {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    serve = commands.add_parser(
        "serve",
        help="start the OpenAI-compatible HTTP server",
        description="Start an OpenAI-compatible server (/v1/completions, /v1/chat/completions, "
        "/v1/models, /tokenize, /detokenize, /v1/watermark/detect, /health, /version, /metrics).",
    )
    serve.add_argument(
        "model",
        nargs="?",
        default=DEFAULT_MODEL,
        help="a HF checkpoint directory, a Hugging Face Hub id (org/name), or a bundled demo "
        f"model name (`minivllm models` lists them); default: {DEFAULT_MODEL}",
    )
    add_server_args(serve)
    add_limit_args(serve)
    add_engine_args(serve)
    worker_cli.add_multinode_args(serve)
    serve.set_defaults(handler=serve_command, parser=serve)
    worker_cli.add_parser(commands)
    watermark_cli.add_parser(commands, default_tokenizer=DEFAULT_MODEL)
    weight_cache_cli.add_parser(commands)
    models = commands.add_parser(
        "models",
        help="list the bundled demo models and their directories",
        description="The bundled demo models, one per line: name, then directory (tools "
        "such as lm-eval take the directory as a tokenizer path).",
    )
    models.set_defaults(handler=models_command, parser=models)
    return parser


def models_command(args: argparse.Namespace) -> int:
    from minivllm.loader.hub import bundled_models

    for name, path in bundled_models().items():
        print(f"{name}\t{path}")
    return 0


def read_chat_template(value: str | None) -> str | None:
    """A file's contents, or the value itself if it looks like a Jinja template."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")


def serve_command(args: argparse.Namespace) -> int:
    """Claim the port, load the model, serve; returns the exit status (0 after a graceful stop)."""
    from minivllm.engine.async_llm import AsyncLLM
    from minivllm.entrypoints.openai.api_server import ServerConfig, bind_socket, run_server
    from minivllm.metrics import EngineMetrics

    try:
        engine_args = engine_args_from(args)
        if args.enable_auto_tool_choice and not args.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes)")
        if args.grpc_port is not None and not args.grpc:
            raise ValueError("--grpc-port needs --grpc")
        if args.watermark_enforce and not args.watermark_config:
            raise ValueError("--watermark-enforce needs --watermark-config: nothing is watermarked")
        config = ServerConfig(
            host=args.host,
            port=args.port,
            api_key=args.api_key or os.environ.get(_API_KEY_ENV) or None,
            served_model_names=tuple(args.served_model_name or (args.model,)),
            chat_template=read_chat_template(args.chat_template),
            tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
            metrics_vllm_alias=args.metrics_vllm_alias,
            max_request_body_bytes=args.max_request_body_bytes,
            limits=limits_from(args),
            shutdown_timeout=args.shutdown_timeout,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            watermark_enforce=args.watermark_enforce,
            watermark_public_detection=args.watermark_public_detection,
            enable_scale_out=args.enable_scale_out,
            grpc=args.grpc,
            grpc_port=args.grpc_port,
        )
    except (ValueError, TypeError) as exc:
        logger.error("%s", exc)
        return 2
    try:
        sock = bind_socket(config.host, config.port)
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", config.host, config.port, exc)
        return 1
    if config.grpc_port:  # gRPC beside HTTP binds once serving: a busy port fails here, first
        try:
            bind_socket(config.host, config.grpc_port).close()
        except OSError as exc:
            logger.error("cannot listen for gRPC on %s:%d: %s", config.host, config.grpc_port, exc)
            sock.close()
            return 1
    metrics = EngineMetrics(
        config.served_model_names[0] if config.served_model_names else args.model
    )
    logger.info("minivllm %s: loading %s", __version__, args.model)
    try:
        async_llm = AsyncLLM.from_engine_args(engine_args, metrics)
    except (ValueError, OSError, RuntimeError) as exc:  # RuntimeError: a TP worker failed
        logger.error("could not start the engine: %s", exc)
        sock.close()
        return 1
    _log_engine(async_llm)
    engine = async_llm.engine
    metrics.record_cache_config(engine.config.cache, engine.kv_cache_manager.pool.num_blocks)
    # The server owns this process, and the model, tokenizer and caches live as long as
    # it: move them out of the collector's view so full collections while serving do not
    # walk them (vLLM freezes after start-up too). Not done in `LLM`, whose process is
    # the user's.
    gc.collect()
    gc.freeze()
    return run_server(async_llm, metrics, config, sock)


def _log_engine(async_llm: AsyncLLM) -> None:
    engine = async_llm.engine
    config = engine.config
    pool = engine.kv_cache_manager.pool
    logger.info(
        "Model %s (%s), dtype %s, device %s, max_model_len %d, KV cache %d tokens "
        "(%d blocks of %d), prefix caching %s, loaded in %.1f s",
        config.model.model,
        config.model.architecture,
        str(config.model.dtype).removeprefix("torch."),
        config.device,
        config.scheduler.max_model_len,
        pool.num_blocks * config.cache.block_size,
        pool.num_blocks,
        config.cache.block_size,
        "on" if config.cache.enable_prefix_caching else "off",
        engine.startup_seconds,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the command's own usage, not the top-level one
        getattr(args, "parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    setup_logging()
    try:
        return args.handler(args)
    except KeyboardInterrupt:  # Ctrl+C before the server started
        return 130


if __name__ == "__main__":
    sys.exit(main())
