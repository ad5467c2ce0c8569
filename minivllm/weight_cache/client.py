"""Talking to a weight-cache daemon: one request per connection (`protocol.py`)."""

from __future__ import annotations

import errno
import os
import socket
import time
from typing import Any

from minivllm.weight_cache.key import WeightCacheKey
from minivllm.weight_cache.protocol import MAX_FDS, MAX_REPLY_BYTES, recv_message, send_message
from minivllm.weight_cache.socket_dir import is_lock_free


class WeightCacheUnavailableError(RuntimeError):
    """No daemon answers on the socket (none started, still loading, or dead)."""


class WeightCacheMismatchError(RuntimeError):
    """The daemon holds weights built under a different key; `fields` names the differences."""

    def __init__(self, fields: list[str]) -> None:
        super().__init__(f"WeightCacheKey mismatch on fields: {fields}")
        self.fields = fields


class WeightCacheClient:
    def __init__(self, path: str, connect_timeout_s: float, state_timeout_s: float) -> None:
        self.path = path
        self.connect_timeout_s = connect_timeout_s
        self.state_timeout_s = state_timeout_s

    def request(self, message: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        with self._connect() as sock:
            sock.settimeout(self.state_timeout_s)
            send_message(sock, message)
            reply, fds = recv_message(sock, MAX_REPLY_BYTES, MAX_FDS)
        if reply.get("status") == "error":
            for fd in fds:
                _close(fd)
            raise RuntimeError(f"weight cache daemon: {reply.get('message')}")
        return reply, fds

    def ping(self) -> dict[str, Any]:
        return self.request({"cmd": "ping"})[0]

    def get_state(self, key: WeightCacheKey) -> tuple[dict[str, Any], list[int]]:
        reply, fds = self.request({"cmd": "get_state", "key": key.to_json()})
        if reply.get("status") == "mismatch":
            raise WeightCacheMismatchError(list(reply.get("fields") or ["<unnamed>"]))
        if reply.get("status") != "ok":
            raise RuntimeError(f"weight cache daemon answered {reply.get('status')!r}")
        return reply, fds

    def release(self) -> None:
        self.request({"cmd": "release"})

    def wait_until_up(self, timeout_s: float) -> None:
        """Ping until the daemon answers or `timeout_s` passes (it binds once loaded)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.ping()
                return
            except WeightCacheUnavailableError:
                if time.monotonic() >= deadline:
                    raise
            time.sleep(0.2)

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.connect_timeout_s)
        try:
            sock.connect(self.path)
        except (FileNotFoundError, ConnectionRefusedError, TimeoutError) as e:
            sock.close()
            stale = isinstance(e, ConnectionRefusedError) and is_lock_free(self.path)
            why = "stale socket of a dead daemon" if stale else errno.errorcode.get(e.errno or 0, e)
            raise WeightCacheUnavailableError(
                f"no weight cache daemon at {self.path} ({why})"
            ) from None
        except BaseException:
            sock.close()
            raise
        return sock


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
