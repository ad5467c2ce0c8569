"""Run `minivllm serve` in a subprocess on a free loopback port, for end-to-end tests."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

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


# The shared servers of test_server.py and test_server_errors.py (fixtures in conftest.py)
MODEL = "tiny-qwen3"
API_KEY = "sk-test-key"
MAX_MODEL_LEN = 256
BODY_LIMIT = 8 << 20
PROMPTS = ["The quick brown fox", "def main():", "import os\nimport sys", "Hello, world"]
GREEDY = {"temperature": 0.0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
# A chat template unlike the tokenizer's, for the --chat-template server.
OTHER_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]: {{ m['content'] }}\n{% endfor %}[assistant]:"
)


def tiny_server_args(
    *extra: str, kv_cache: str = "4MiB", max_model_len: int = MAX_MODEL_LEN
) -> list[str]:
    """`minivllm serve` flags for the tiny test checkpoint, then `extra`."""
    return [
        "--served-model-name",
        MODEL,
        "--dtype",
        "float32",
        "--max-model-len",
        str(max_model_len),
        "--kv-cache-memory-bytes",
        kv_cache,
        *extra,
    ]


def greedy_text(client: openai.OpenAI, prompt: str) -> str:
    return client.completions.create(model=MODEL, prompt=prompt, **GREEDY).choices[0].text


def metrics(server: RemoteServer) -> dict[str, float]:
    """Every sample as `name{label="v",...}` -> value (labels sorted, model_name left out)."""
    text = httpx.get(server.url + "/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(
                f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "model_name"
            )
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def post(server: RemoteServer, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=60, **kwargs)


def assert_error(response: httpx.Response, status: int, *needles: str) -> dict[str, Any]:
    assert response.status_code == status, response.text[:2000]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for needle in needles:
        assert needle in error["message"], error
    return error
