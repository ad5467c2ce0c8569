"""Run `minivllm serve` in a subprocess on a free loopback port, for end-to-end tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
_URL_LINE = re.compile(r"Serving .* at (http://\S+) ")


class RemoteServer:
    """`minivllm serve MODEL --port 0 ...`; the URL is read from its start-up log."""

    def __init__(self, model: str | Path, args: list[str], log_path: Path) -> None:
        self.log_path = log_path
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TOKENIZERS_PARALLELISM": "false"}
        env.pop("MINIVLLM_API_KEY", None)
        cmd = [sys.executable, "-m", "minivllm.entrypoints.cli", "serve", str(model), "--port", "0"]
        self._log = open(log_path, "w")  # closed in stop()
        self.proc = subprocess.Popen(
            [*cmd, *args], stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env
        )
        self.url: str | None = None

    def wait_ready(self, timeout: float = 180.0) -> RemoteServer:
        """Block until /health answers 200 (the timeout only guards against a hung start)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            if self.url is None:
                match = _URL_LINE.search(self.log())
                self.url = match.group(1) if match else None
            if self.url is not None:
                try:
                    if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                        return self
                except httpx.TransportError:
                    pass
            time.sleep(0.1)
        raise RuntimeError(f"the server did not become ready:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Signal the server and return its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
