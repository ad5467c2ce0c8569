"""The Shepherd Model Gateway (`smg launch`, router only) in front of minivllm servers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Gateway:
    """`smg launch` (router only) over existing worker URLs, on loopback ports."""

    def __init__(self, worker_urls: list[str], log_path: Path) -> None:
        self.port, metrics_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "smg",
            "launch",
            "--worker-urls",
            *worker_urls,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--policy",
            "round_robin",
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(metrics_port),
            "--shutdown-grace-period-secs",
            "1",
            "--log-level",
            "warn",
        ]
        self._log = open(log_path, "w")  # closed in stop()
        self.log_path = log_path
        env = {**os.environ, "NO_COLOR": "1"}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, num_workers: int, timeout: float = 120.0) -> Gateway:
        """Until every worker is registered and healthy (the timeout guards a hung start)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited with {self.proc.returncode}:\n{self.log()}")
            try:
                workers = httpx.get(self.url + "/workers", timeout=5).json()["workers"]
                if sum(w.get("is_healthy", False) for w in workers) == num_workers:
                    return self
            except (httpx.TransportError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"smg did not become ready:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
