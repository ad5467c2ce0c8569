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


# Tensors freed while kept, then the release a finished load calls; prints the anonymous
# resident memory (MiB) after freeing and after the release.
RELEASE = """
import torch
from minivllm.utils.memory import keep_freed_host_memory, release_freed_host_memory
def anonymous_resident_bytes():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon:"))
applied = keep_freed_host_memory()
xs = [torch.ones(2 << 20) for _ in range(40)]
keep = torch.ones(16)  # allocated last: the freed ones are not at the heap's top only
del xs
kept = anonymous_resident_bytes()
release_freed_host_memory()
print(applied, kept >> 20, anonymous_resident_bytes() >> 20)
"""


def test_a_finished_load_hands_freed_memory_back() -> None:
    """`release_freed_host_memory` (called once a load is processed) returns the 320 MiB
    that `keep_freed_host_memory` had kept after they were freed."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", RELEASE], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    if out[0] != "True":
        pytest.skip("not glibc on Linux: no mallopt, nothing kept to hand back")
    kept, after = int(out[1]), int(out[2])
    assert kept - after > 250, (kept, after)
