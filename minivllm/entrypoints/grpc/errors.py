"""gRPC statuses with bounded messages, from the same checks and errors the HTTP server uses."""

from __future__ import annotations

import grpc

from minivllm.entrypoints.openai.errors import MAX_MESSAGE_CHARS, APIError, bounded

# The HTTP statuses the shared checks raise, as the gRPC codes that mean the same.
_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.UNAVAILABLE,  # a full queue: retry later, or elsewhere (gRPC's mapping)
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
}


class StatusError(Exception):
    """A request answered with `code` and a message whose size never depends on the input."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = bounded(message, MAX_MESSAGE_CHARS)

    @classmethod
    def from_api_error(cls, error: APIError) -> StatusError:
        return cls(_CODES.get(error.status, grpc.StatusCode.INTERNAL), error.message)


def invalid(message: str) -> StatusError:
    return StatusError(grpc.StatusCode.INVALID_ARGUMENT, message)


def unsupported(message: str) -> StatusError:
    """A capability of vLLM's protocol that minivllm does not have."""
    return StatusError(grpc.StatusCode.UNIMPLEMENTED, message)
