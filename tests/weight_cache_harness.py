"""The weight-cache daemon harness the Fast Start tests share: daemons run as
subprocesses (`python -m minivllm.weight_cache`) on a tiny bf16 Qwen3 checkpoint, each
with its own socket directory. The fixtures `bf16_dir` and `start_daemon` are in
conftest.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from minivllm import SamplingParams
from minivllm.weight_cache.socket_dir import socket_path

REPO = Path(__file__).resolve().parents[1]
MAX_LEN = 256
ENGINE = dict(dtype="bfloat16", max_model_len=MAX_LEN, kv_cache_memory_bytes=8 << 20)
PROMPTS = ["def main(", "import os\nimport"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3)


class Daemon:
    def __init__(self, model_dir: Path, socket_dir: Path, log: Path, *args: str) -> None:
        self.socket_dir, self.log = socket_dir, log
        self.path = socket_path(str(socket_dir))
        cmd = [sys.executable, "-m", "minivllm.weight_cache", str(model_dir)]
        cmd += ["--dtype", "bfloat16", "--max-model-len", str(MAX_LEN)]
        cmd += ["--socket-dir", str(socket_dir), *args]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        with open(log, "w") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self) -> Daemon:
        deadline = time.monotonic() + 600  # a safety net (a kernel build may come first)
        while "READY" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"daemon did not start:\n{self.log.read_text()}")
            time.sleep(0.1)
        return self

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


def short_dir() -> Path:
    """A socket directory short enough for AF_UNIX's 108-byte paths (pytest's are long)."""
    return Path(tempfile.mkdtemp(prefix="wc", dir="/tmp"))


def assert_same_outputs(outputs: list[Any], expected: list[Any]) -> None:
    for got, want in zip(outputs, expected, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].logprobs == want.outputs[0].logprobs


def disk_outputs_of(model_dir: Path, **engine: Any) -> list[Any]:
    """PROMPTS' greedy outputs from an engine that loads `model_dir` from disk."""
    from minivllm import LLM

    llm = LLM(str(model_dir), **engine)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.llm_engine.shutdown()
    return outputs
