"""The weight cache's wire format: JSON messages, shared memory as file descriptors.

One request and one reply per connection, over an AF_UNIX stream socket:

    | length: 8 bytes, big-endian | JSON object, `length` bytes, UTF-8 |
      (SCM_RIGHTS: the reply's fds ride on these 8 bytes)

No pickle: a message is data, never code, so a confused or hostile peer can at worst
send a bad manifest (which the client validates), not run anything. Requests are
`{"cmd": "ping" | "get_state" | "release", ...}`; replies carry `"status": "ok" |
"mismatch" | "error"`.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from collections.abc import Sequence
from typing import Any

_HEADER = struct.Struct("!Q")
MAX_REQUEST_BYTES = 1 << 20  # a request is a command and a cache key
MAX_REPLY_BYTES = 256 << 20  # a reply is a manifest: ~200 bytes a tensor
MAX_FDS = 64
COMMANDS = ("ping", "get_state", "release")


class ProtocolError(ValueError):
    """A message that breaks the framing or is not a JSON object within bounds."""


def send_message(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    payload = json.dumps(message, separators=(",", ":")).encode()
    header = _HEADER.pack(len(payload))
    if fds:
        socket.send_fds(sock, [header], list(fds))
    else:
        sock.sendall(header)
    sock.sendall(payload)


def recv_message(
    sock: socket.socket, max_bytes: int, max_fds: int = 0
) -> tuple[dict[str, Any], list[int]]:
    """One framed message and the fds that came with it; the caller owns (closes) the fds."""
    fds: list[int] = []
    if max_fds:
        head, fds, _, _ = socket.recv_fds(sock, _HEADER.size, max_fds)
    else:
        head = sock.recv(_HEADER.size)
    try:
        head += _recv_exact(sock, _HEADER.size - len(head))
        (length,) = _HEADER.unpack(head)
        if length > max_bytes:
            raise ProtocolError(f"message of {length} bytes exceeds the limit of {max_bytes}")
        try:
            message = json.loads(_recv_exact(sock, length))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ProtocolError(f"message is not JSON: {e}") from None
        if not isinstance(message, dict):
            raise ProtocolError("message is not a JSON object")
    except BaseException:
        for fd in fds:
            _close(fd)
        raise
    return message, fds


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks = []
    while size > 0:
        chunk = sock.recv(min(size, 1 << 20))
        if not chunk:
            raise ProtocolError("connection closed mid-message")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def error_reply(message: str) -> dict[str, Any]:
    return {"status": "error", "message": message}
