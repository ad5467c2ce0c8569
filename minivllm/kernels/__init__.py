"""Optional CPU kernels, compiled on first use with torch's cpp_extension (gcc is enough).

Each kernel has a plain-PyTorch fallback; `get_cpu_kernels()` returns None where the
CPU lacks the instructions, the compiler is missing, or the build fails.
"""

from __future__ import annotations

import logging
import os
from functools import cache
from types import ModuleType

logger = logging.getLogger("minivllm")


def cpu_has_avx512_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return all(flag in flags.split() for flag in ("avx512f", "avx512bw", "avx512_bf16"))


@cache
def get_cpu_kernels() -> ModuleType | None:
    if not cpu_has_avx512_bf16():
        return None
    from torch.utils.cpp_extension import load

    build_dir = os.path.join(os.path.expanduser("~"), ".cache", "minivllm", "kernels")
    os.makedirs(build_dir, exist_ok=True)
    source = os.path.join(os.path.dirname(__file__), "gemv_bf16.cpp")
    try:
        return load(
            name="minivllm_cpu_kernels",
            sources=[source],
            extra_cflags=["-O3", "-march=native", "-mavx512bf16", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=build_dir,
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 (any build failure means: use the fallback)
        logger.warning("CPU kernels unavailable, using stock PyTorch linears (%s)", exc)
        return None
