"""`keep_freed_host_memory`: glibc keeps freed activation memory instead of returning it
to the kernel, so steps after the first do not fault their pages in again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# One "step": 40 tensors of 8 MiB allocated, touched and freed together, as a forward's
# activations are. Prints the minor page faults of five steps after a first one.
STEPS = """
import resource, sys, torch
from minivllm.utils.memory import keep_freed_host_memory
applied = keep_freed_host_memory() if sys.argv[1] == "on" else False
def step():
    xs = [torch.ones(2 << 20) for _ in range(40)]
    del xs
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> tuple[bool, int]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", STEPS, mode], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0] == "True", int(out[1])


def test_freed_memory_is_reused_without_new_page_faults() -> None:
    applied, tuned = _faults("on")
    if not applied:
        pytest.skip("not glibc on Linux: no mallopt to tune")
    _, default = _faults("off")
    # 5 steps x 320 MiB: ~80 k pages each time by default; a small fraction when kept
    assert default > 40_000 and tuned < default / 4, (default, tuned)


def test_opt_out(monkeypatch) -> None:
    from minivllm.utils.memory import MALLOC_TUNING_ENV, keep_freed_host_memory

    monkeypatch.setenv(MALLOC_TUNING_ENV, "0")
    assert keep_freed_host_memory() is False
