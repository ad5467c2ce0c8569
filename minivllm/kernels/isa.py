"""The CPU's instruction-set extensions, read once from /proc/cpuinfo.

`MINIVLLM_CPU_ISA=avx2` caps what minivllm believes the CPU has at AVX2 + FMA (no
AVX-512, no AMX): the AVX2 kernels and defaults then run on a newer CPU, for tests and
for estimating an AVX2-only machine (with torch's own caps: `ATEN_CPU_CAPABILITY=avx2`,
`ONEDNN_MAX_CPU_ISA=AVX2`, `MKL_ENABLE_INSTRUCTIONS=AVX2`).
"""

from __future__ import annotations

import os
from functools import cache

# the caps MINIVLLM_CPU_ISA takes: a flag survives the cap when it starts with none of these
_CAPPED_PREFIXES = {"avx2": ("avx512", "amx", "avx_vnni", "avx_ne_convert", "avx_ifma")}

# what the fp32 (AVX2) family's AVX-512 code needs: int8_w8a8's VNNI GEMM (avx2_vnni.cpp)
# and the int8/int4 rows' AVX-512 form (avx512_quantw.cpp), for AVX-512 CPUs without
# AVX512-BF16 (Intel Ice Lake, Cascade Lake)
AVX512_VNNI_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})

# the extensions minivllm's kernels or its start-up log care about
_REPORTED = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "amx_tile")


@cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    flags = frozenset(line.partition(":")[2].split())
    cap = isa_cap()
    if cap:
        if cap not in _CAPPED_PREFIXES:
            raise ValueError(
                f"MINIVLLM_CPU_ISA={cap!r} is not a cap minivllm knows; use one of "
                f"{sorted(_CAPPED_PREFIXES)} or unset it"
            )
        flags = frozenset(f for f in flags if not f.startswith(_CAPPED_PREFIXES[cap]))
    return flags


def isa_cap() -> str | None:
    """The MINIVLLM_CPU_ISA cap in force, if any (for logs and benchmark headers)."""
    return os.environ.get("MINIVLLM_CPU_ISA", "").strip().lower() or None


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
    summary = " ".join(f for f in _REPORTED if f in flags) or "none of avx2/avx512/amx"
    cap = isa_cap()
    return summary + (f" (capped: MINIVLLM_CPU_ISA={cap})" if cap else "")


def cpu_has_avx512_bf16() -> bool:
    return {"avx512f", "avx512bw", "avx512_bf16"} <= cpu_flags()
