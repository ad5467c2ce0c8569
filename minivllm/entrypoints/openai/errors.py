"""OpenAI-style error bodies whose size never depends on the input.

Every error is `{"error": {"message", "type", "param", "code"}}`. Messages are
built from field names and limits, never from the submitted values; anything
that might still echo input (an engine message, a dict key in a location) is
cut, and the whole message is capped at `MAX_MESSAGE_CHARS`. (vLLM v0.30 fixed
a ~5,300x response amplification where validation errors echoed the input.)
"""

from __future__ import annotations

import re
from typing import Any

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails
from starlette.responses import JSONResponse

from minivllm.sampling_params import SamplingParams

MAX_MESSAGE_CHARS = 1024
MAX_PART_CHARS = 200
_MAX_LOC_PART_CHARS = 40
_MAX_ERRORS = 3
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}
# Pydantic names union members in error locations ("str", "list[constrained-int]", "TextPart").
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|constrained-\w+|(list|dict)\[.*\]|[A-Z]\w*)$")
_SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__)
_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


class APIError(Exception):
    """An error answered to the client with `status` and a bounded message."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = bounded(message, MAX_MESSAGE_CHARS)
        self.param = bounded(param, _MAX_LOC_PART_CHARS * 4) if param else None


def bounded(text: str, limit: int = MAX_PART_CHARS) -> str:
    """`text`, cut to at most `limit` characters with a marker saying how much was dropped."""
    if len(text) <= limit:
        return text
    marker = f"... [{len(text) - limit} characters truncated]"
    return text[: max(limit - len(marker), 0)] + marker


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": bounded(message, MAX_MESSAGE_CHARS),
            "type": _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
            "param": param,
            "code": status,
        }
    }


def error_response(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(error.status, error.message, error.param), error.status, headers)


def from_value_error(exc: Exception) -> APIError:
    """A ValueError/TypeError from `SamplingParams` or the engine: 400, naming the field it names.

    `SamplingParams` messages start with the field (`n must be in [1, 128], got 0`).
    """
    message = str(exc) or type(exc).__name__
    first_word = message.split(" ", 1)[0].split("[", 1)[0]
    return APIError(400, message, first_word if first_word in _SAMPLING_FIELDS else None)


def from_validation_error(exc: ValidationError, model: type[BaseModel]) -> APIError:
    """A bounded 400 from pydantic's errors: location, reason, allowed range; never the input."""
    errors = exc.errors(include_url=False, include_input=False, include_context=True)
    if errors and errors[0]["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {_reason(errors[0])}")
    picked, num_fields = _pick_errors(errors)
    parts = [_describe(err, model) for err in picked]
    more = num_fields - len(picked)
    message = "; ".join(parts) + (f" (and errors in {more} more fields)" if more > 0 else "")
    param = _clean_loc(picked[0]["loc"])[:1] if picked else []
    return APIError(400, message, str(param[0]) if param else None)


def _pick_errors(errors: list[ErrorDetails]) -> tuple[list[ErrorDetails], int]:
    """One error per field: for a union, the most specific member's (deepest, not a type mismatch)."""
    by_field: dict[str, list[ErrorDetails]] = {}
    for err in errors:
        by_field.setdefault(str(err["loc"][:1]), []).append(err)
    picked = []
    for group in by_field.values():
        if len(group) == 1:
            picked.append(group[0])
            continue
        best = max(
            group, key=lambda e: (len(_clean_loc(e["loc"])), not e["type"].endswith("_type"))
        )
        if len(_clean_loc(best["loc"])) == 1 and best["type"].endswith("_type"):
            best = {**best, "msg": _union_expectation(group), "type": "union"}
        picked.append(best)
    return picked[:_MAX_ERRORS], len(picked)


def _union_expectation(group: list[ErrorDetails]) -> str:
    tags = [str(e["loc"][1]) for e in group if len(e["loc"]) > 1 and _is_union_tag(e["loc"][1])]
    kinds = ", ".join(dict.fromkeys(t.replace("constrained-", "") for t in tags))
    return f"Input should be one of: {kinds}" if kinds else "Input has the wrong type"


def _describe(err: ErrorDetails, model: type[BaseModel]) -> str:
    loc = _clean_loc(err["loc"])
    where = ".".join(bounded(str(p), _MAX_LOC_PART_CHARS) for p in loc) or "body"
    message = f"{where}: {_reason(err)}"
    if err["type"] in _RANGE_ERRORS and len(loc) == 1:
        allowed = _allowed_range(model, str(loc[0]))
        if allowed:
            message += f" (allowed range: {allowed})"
    return bounded(message, MAX_PART_CHARS)


def _reason(err: ErrorDetails) -> str:
    message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    return bounded(message, MAX_PART_CHARS)


def _clean_loc(loc: tuple[Any, ...]) -> list[Any]:
    return [part for part in loc if not (isinstance(part, str) and _is_union_tag(part))]


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and bool(_UNION_TAG.match(part))


def _allowed_range(model: type[BaseModel], name: str) -> str | None:
    """A field's bounds as an interval, e.g. `[1, 128]` or `(0.0, 1.0]`, from its constraints."""
    field = model.model_fields.get(name)
    if field is None:
        return None
    low: Any = None
    high: Any = None
    low_open = high_open = False
    for item in field.metadata:
        if isinstance(item, Ge):
            low = item.ge
        elif isinstance(item, Gt):
            low, low_open = item.gt, True
        elif isinstance(item, Le):
            high = item.le
        elif isinstance(item, Lt):
            high, high_open = item.lt, True
    if low is None and high is None:
        return None
    left = "(" if low_open or low is None else "["
    right = ")" if high_open or high is None else "]"
    return f"{left}{'-inf' if low is None else low}, {'inf' if high is None else high}{right}"
