"""The server's OpenAPI document: request bodies and answers for routes that parse their own.

Routes read the raw body and validate it themselves (bounded errors, strict
types), so FastAPI cannot see their request models; `body_route` registers a
route with its model and the statuses it may answer, and `install_openapi`
puts those models into `/openapi.json`. Clients, gateways and the fuzzer
(`tests/test_fuzz.py`, schemathesis) read the document.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

_REF = "#/components/schemas/{model}"
# every route that takes a body may answer these, besides its own
BODY_ERRORS = (400, 401, 404, 413, 415, 429, 500, 503)
_DESCRIPTIONS = {
    200: "OK",
    400: "an invalid request (the field is named)",
    401: "a missing or wrong API key",
    404: "an unknown model or route",
    413: "the body is over --max-request-body-bytes",
    415: "the body is not JSON",
    429: "the engine's queue is full; retry later",
    500: "the engine failed while running this request",
    503: "the server is shutting down or its engine has stopped",
}


def _object(required: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {"type": "object", "required": list(required), "properties": required, **more}


_USAGE = _object(
    {
        "prompt_tokens": {"type": "integer", "minimum": 0},
        "completion_tokens": {"type": "integer", "minimum": 0},
        "total_tokens": {"type": "integer", "minimum": 0},
    }
)
_CHOICES = {"type": "array", "maxItems": 256 * 128}
# what 200 answers hold, for the routes clients parse (others: a JSON object)
COMPLETION = _object(
    {
        "id": {"type": "string"},
        "object": {"const": "text_completion"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {
            **_CHOICES,
            "items": _object({"index": {"type": "integer"}, "text": {"type": "string"}}),
        },
        "usage": _USAGE,
    }
)
CHAT_COMPLETION = _object(
    {
        "id": {"type": "string"},
        "object": {"const": "chat.completion"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {
            **_CHOICES,
            "items": _object({"index": {"type": "integer"}, "message": {"type": "object"}}),
        },
        "usage": _USAGE,
    }
)
TOKENIZE = _object(
    {
        "count": {"type": "integer", "minimum": 0},
        "max_model_len": {"type": "integer", "minimum": 1},
        "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    }
)
DETOKENIZE = _object({"prompt": {"type": "string"}})


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    """Every error body: OpenAI's shape, with a bounded message."""

    error: ErrorDetail


def body_route(
    app: FastAPI,
    path: str,
    endpoint: Callable[..., Any],
    request_model: type[BaseModel],
    streams: bool = False,
    answer: dict[str, Any] | None = None,
    statuses: tuple[int, ...] = BODY_ERRORS,
) -> None:
    """`POST path`, documented as taking `request_model` as JSON and answering JSON of the
    schema `answer` (an object by default), or server-sent events (each a JSON object
    or `[DONE]`) when `streams`, with 200, or an `ErrorResponse` with `statuses`."""
    ok: dict[str, Any] = {"application/json": {"schema": answer or {"type": "object"}}}
    if streams:
        ok["text/event-stream"] = {"schema": {}}
    error = {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}}
    responses: dict[int | str, Any] = {200: {"description": "OK", "content": ok}}
    for status in statuses:
        responses[status] = {"description": _DESCRIPTIONS[status], "content": error}
    openapi_extra = {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": _REF.format(model=request_model.__name__)}}
            },
        }
    }
    app.add_api_route(
        path,
        endpoint,
        methods=["POST"],
        openapi_extra=openapi_extra,
        responses=responses,
    )
    _models(app).add(request_model)


def install_openapi(app: FastAPI) -> None:
    """Make `app.openapi()` include the models `body_route` registered."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = build()
        models = sorted({*_models(app), ErrorResponse}, key=lambda m: m.__name__)
        top, defs = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        schemas.update(defs.get("$defs", {}))
        for (model, _), schema in top.items():
            schemas.setdefault(model.__name__, schema)
        app.openapi_schema = document
        return document

    app.openapi = openapi  # type: ignore[method-assign]


def _models(app: FastAPI) -> set[type[BaseModel]]:
    if not hasattr(app.state, "body_models"):
        app.state.body_models = set()
    return app.state.body_models
