"""The CPU's instruction-set extensions, read once from /proc/cpuinfo."""

from __future__ import annotations

from functools import cache

# the extensions minivllm's kernels or its start-up log care about
_REPORTED = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "amx_tile")


@cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


@cache
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return "unknown CPU"


def isa_summary() -> str:
    """`avx2 avx512f ... amx_bf16`: the extensions present, for logs and benchmark headers."""
    flags = cpu_flags()
    return " ".join(f for f in _REPORTED if f in flags) or "none of avx2/avx512/amx"


def cpu_has_avx512_bf16() -> bool:
    return {"avx512f", "avx512bw", "avx512_bf16"} <= cpu_flags()
