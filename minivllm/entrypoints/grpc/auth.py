"""`--api-key` for gRPC: the key as `authorization: Bearer KEY` metadata, as for HTTP."""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED unless the call carries the key; `open_methods` (health) stay open."""

    def __init__(self, api_key: str, open_methods: Iterable[str]) -> None:
        self.expected = f"Bearer {api_key}".encode()
        self.open_methods = frozenset(open_methods)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method in self.open_methods:
            return handler
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if secrets.compare_digest(given.encode(), self.expected):
            return handler
        reason = "a wrong API key was given" if given else "no API key was given"
        return _refusal(handler, f"{reason}; send 'authorization: Bearer <key>' metadata")


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
