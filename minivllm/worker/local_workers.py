"""This host's tensor-parallel ranks as child processes, each with a socket pair to its parent.

Each rank runs `python -m minivllm.worker FD` (no `multiprocessing` spawn: the
parent's `__main__` is never re-imported, so scripts without a main guard and
notebooks work, and no resource-tracker process is left behind). A child that
exits closes its end of the pair, which is how the parent notices a death
within one `wait()`, whatever killed it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import minivllm
from minivllm.config import EngineConfig
from minivllm.worker.worker import WorkerFailure, WorkerSpec

_REPORT_GRACE_S = 1.0  # after a failure, how long the other ranks get to report theirs


class WorkerError(RuntimeError):
    """A tensor-parallel rank failed or died; the message carries every rank's report."""


@dataclass(slots=True, eq=False)
class _Child:
    rank: int
    proc: subprocess.Popen
    conn: Connection
    failure: WorkerFailure | None = None
    is_gone: bool = False  # its end of the pipe closed: it exited

    def describe_exit(self) -> str:
        code = self.proc.poll()
        if code is None:
            return "closed its pipe but still runs"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with status {code}"


class LocalWorkers:
    """Start the ranks in `specs` (rank 0 also gets `config`) and watch them."""

    def __init__(self, specs: list[WorkerSpec], config: EngineConfig | None) -> None:
        self.children: list[_Child] = []
        for spec in specs:
            self.children.append(self._start(spec, config if spec.rank == 0 else None))

    @staticmethod
    def _start(spec: WorkerSpec, config: EngineConfig | None) -> _Child:
        proc, conn = spawn_child("minivllm.worker")
        child = _Child(spec.rank, proc, conn)
        try:
            child.conn.send((spec, config))
        except OSError:
            child.is_gone = True
        return child

    @property
    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.children]

    def send(self, rank: int, message: Any) -> None:
        try:
            self._child(rank).conn.send(message)
        except OSError:
            raise self._failure() from None

    def receive(self, rank: int) -> Any:
        """Wait for `rank`'s answer; a local rank failing or dying meanwhile raises WorkerError."""
        child = self._child(rank)
        while not child.is_gone:
            for ready in wait([c.conn for c in self.children if not c.is_gone]):
                other = next(c for c in self.children if c.conn is ready)
                message = self._read(other)
                if message is None or message[0] == "error":
                    raise self._failure()
                if other is child:
                    return message[1]
        raise self._failure()

    def wait_all(self) -> WorkerError | None:
        """Block until every rank has exited (a headless node); the failure, if one failed."""
        while live := [c.conn for c in self.children if not c.is_gone]:
            for ready in wait(live):
                message = self._read(next(c for c in self.children if c.conn is ready))
                if message is not None and message[0] == "error":
                    return self._failure()
        for c in self.children:
            c.proc.wait()
        if any(c.proc.returncode for c in self.children):
            return self._failure()
        return None

    def stop(self, timeout: float = 10.0) -> None:
        """Give the ranks `timeout` seconds to exit, then terminate (and kill) the rest."""
        deadline = time.monotonic() + timeout
        for c in self.children:
            try:
                c.proc.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                c.proc.terminate()
        for c in self.children:
            try:
                c.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
            c.conn.close()

    def _child(self, rank: int) -> _Child:
        return next(c for c in self.children if c.rank == rank)

    @staticmethod
    def _read(child: _Child) -> tuple[str, Any] | None:
        """The child's next message, or None once it has gone (then `is_gone` is set)."""
        try:
            message = child.conn.recv()
        except (EOFError, OSError):
            child.is_gone = True
            return None
        if message[0] == "error":
            child.failure = message[1]
        return message

    def _failure(self) -> WorkerError:
        """Let the other ranks report for a moment, then one error naming every casualty.

        Ranks that died without a word come first (a signal, most likely the root
        cause), then tracebacks in the order they happened: a rank whose peer
        died fails later, with a collective error, so the cause leads.
        """
        deadline = time.monotonic() + _REPORT_GRACE_S
        while (live := [c for c in self.children if not c.is_gone]) and (
            left := deadline - time.monotonic()
        ) > 0:
            for ready in wait([c.conn for c in live], timeout=left):
                self._read(next(c for c in live if c.conn is ready))
        for c in self.children:
            if c.is_gone:
                try:
                    c.proc.wait(1.0)
                except subprocess.TimeoutExpired:
                    pass
        silent = [c for c in self.children if c.is_gone and c.failure is None]
        lines = [f"rank {c.rank} (pid {c.proc.pid}) {c.describe_exit()}" for c in silent]
        by_text: dict[str, list[WorkerFailure]] = {}
        for f in sorted((c.failure for c in self.children if c.failure), key=lambda f: f.time):
            by_text.setdefault(f.traceback, []).append(f)
        for text, same in by_text.items():  # identical tracebacks (all ranks at load) once
            who = ", ".join(f"{f.rank} (pid {f.pid})" for f in same)
            lines.append(f"rank{'s' if len(same) > 1 else ''} {who} failed:\n{text.rstrip()}")
        return WorkerError(
            "a tensor-parallel worker failed; the engine cannot continue.\n" + "\n".join(lines)
        )


def spawn_child(module: str) -> tuple[subprocess.Popen, Connection]:
    """`python -m module FD`, FD one end of a new socket pair; the other end as a Connection."""
    parent_sock, child_sock = socket.socketpair()
    with child_sock:
        fd = child_sock.fileno()
        proc = subprocess.Popen(
            [sys.executable, "-m", module, str(fd)], pass_fds=(fd,), env=_child_env()
        )
    return proc, Connection(parent_sock.detach())


def _child_env() -> dict[str, str]:
    """The parent's environment, with minivllm importable even when it is not installed."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(minivllm.__file__)))
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{path}{os.pathsep}{root}" if path else root}
