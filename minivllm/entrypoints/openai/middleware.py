"""Pure ASGI middleware (no buffering of responses, so streaming and disconnects pass through)."""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minivllm.entrypoints.openai.errors import APIError, error_response

# A body declared bigger than this many times the limit is refused without reading it;
# smaller ones are drained first, so the client can read the 413 instead of a reset.
_MAX_DRAIN_FACTOR = 4
_MAX_DRAIN_BYTES = 1 << 20  # a refused body is read this far, then the connection closes


class ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <key>`; `open_paths` (health, metrics) stay open."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: Iterable[str]) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if secrets.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        reason = "a wrong API key was given" if given else "no API key was given"
        error = APIError(401, f"Unauthorized: {reason}; send 'Authorization: Bearer <key>'")
        await error_response(error, {"WWW-Authenticate": "Bearer"})(scope, receive, send)


class JsonOnlyMiddleware:
    """415 for a POST whose Content-Type is not JSON.

    A web page may send `text/plain`, form or multipart bodies (and bodies of no type)
    to any server its visitor's browser can reach, without a CORS preflight; only a
    JSON content type makes the browser ask first. A server started without an API key
    on a reachable address would otherwise take orders from any page its users open.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or _is_json(scope):
            await self.app(scope, receive, send)
            return
        error = APIError(
            415, "the request body must be JSON: send 'Content-Type: application/json'"
        )
        await _drain(receive, 0, _MAX_DRAIN_BYTES)
        await error_response(error)(scope, receive, send)


def _is_json(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"content-type":
            media_type = value.split(b";", 1)[0].strip().lower()
            return media_type == b"application/json" or (
                media_type.startswith(b"application/") and media_type.endswith(b"+json")
            )
    return False


class BodyLimitMiddleware:
    """413 for request bodies over `max_bytes` (declared or streamed), before the app sees them."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            if declared <= _MAX_DRAIN_FACTOR * self.max_bytes:
                await _drain(receive)
            await self._refuse(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await _drain(receive, size, _MAX_DRAIN_FACTOR * self.max_bytes)
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(
            413, f"the request body is larger than the limit of {self.max_bytes} bytes"
        )
        await error_response(error, {"Connection": "close"})(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _drain(receive: Receive, size: int = 0, limit: int | None = None) -> None:
    while limit is None or size <= limit:
        message = await receive()
        size += len(message.get("body", b""))
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            return


def _replay(body: bytes, receive: Receive) -> Any:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()  # after the body: only http.disconnect remains
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
