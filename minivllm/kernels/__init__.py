"""Optional CPU kernels, compiled on first use with torch's cpp_extension (gcc is enough).

Two families, each its own extension module: the bf16 one for CPUs with AVX512-BF16
(`get_cpu_kernels`) and the fp32 one for CPUs with only AVX2 + FMA (+ F16C) (`get_avx2_kernels`).
Each kernel has a plain-PyTorch fallback; the getters return None where the CPU lacks
the instructions, the compiler is missing, or the build fails. Layers reach
the ops through `registry.Kernels`, never this module. The build lands in the user's
cache directory (`$XDG_CACHE_HOME/minivllm/kernels`, else `~/.cache/minivllm/kernels`).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
from functools import cache
from types import ModuleType

from minivllm.kernels.isa import AVX512_VNNI_FLAGS, cpu_flags, cpu_has_avx512_bf16
from minivllm.utils.paths import cache_dir

logger = logging.getLogger("minivllm")


def kernel_build_dir() -> str:
    return os.path.join(cache_dir(), "kernels")


# explicit ISA flags, not -march=native: a cached build may meet another CPU
_AVX512_BF16_FLAGS = ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"]
_AVX2_FLAGS = ["-mavx2", "-mfma", "-mf16c"]


@cache
def get_avx2_kernels() -> ModuleType | None:
    """The fp32 AVX2 + FMA (+ F16C) family (avx2_*.cpp), for CPUs without AVX-512."""
    if not {"avx2", "fma", "f16c"} <= cpu_flags():
        return None
    module = _build_family(
        "minivllm_cpu_kernels_avx2",
        "avx2",
        (
            "avx2_linear.cpp",
            "avx2_quant.cpp",
            "avx2_attention.cpp",
            "avx2_ops.cpp",
            "avx2_decode.cpp",
            "avx2_moe.cpp",
            "moe_routing.cpp",
            # AVX-512 code under its own target, run only where the CPU has it
            "avx2_vnni.cpp",
            "avx512_quantw.cpp",
            "pack_weights.cpp",
        ),
        _AVX2_FLAGS,
    )
    if module is not None:  # linear_quantw's AVX-512 form where cpu_flags() (the cap) allows
        module.set_quantw_avx512(AVX512_VNNI_FLAGS <= cpu_flags())
    return module


@cache
def get_cpu_kernels() -> ModuleType | None:
    """The bf16 AVX512-BF16 family."""
    if not cpu_has_avx512_bf16():
        return None
    return _build_family(
        "minivllm_cpu_kernels",
        "",  # the cache directory itself, where earlier versions built it
        (
            "gemv_bf16.cpp",
            "paged_attention.cpp",
            "fused_ops.cpp",
            "decode_layers.cpp",
            "prefill_attention.cpp",
            "watermark.cpp",
            "quant_gemm.cpp",
            "dequantize.cpp",
            "quant_w8a8.cpp",
            "quantize_weight.cpp",
            "pack_weights.cpp",
            "int4_w4a8.cpp",
            "amx_w8a8.cpp",
            "amx_weight_only.cpp",
            "dsa.cpp",
            "moe.cpp",
            "moe_quant.cpp",
            "moe_routing.cpp",
        ),
        _AVX512_BF16_FLAGS,
    )


def _build_family(
    name: str, subdir: str, files: tuple[str, ...], isa_flags: list[str]
) -> ModuleType | None:
    build_dir = os.path.join(kernel_build_dir(), subdir) if subdir else kernel_build_dir()
    os.makedirs(build_dir, exist_ok=True)
    here = os.path.dirname(__file__)
    # cpp_extension rebuilds when the sources or flags change; the headers' hash, as a
    # flag, makes an edit of kernels.h or quant_rows.h count too
    header_hash = _headers_hash(here)
    # torch's build lock is a plain file: a process killed mid-build leaves it behind and
    # every later start waits on it forever. Our flock dies with its holder, and every
    # build into this directory takes it first, so a torch lock found under it is stale.
    with open(os.path.join(build_dir, "minivllm.lock"), "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        stale = os.path.join(build_dir, "lock")
        if os.path.exists(stale):
            logger.warning("removing a stale build lock left by an interrupted build: %s", stale)
            os.remove(stale)
        sources, changed = _stage_sources(here, build_dir, files)
        if changed or not os.path.exists(os.path.join(build_dir, f"{name}.so")):
            logger.info(
                "compiling minivllm's CPU kernels into %s (once per version; minutes on 2 cores)",
                build_dir,
            )
        return _build(name, build_dir, sources, isa_flags, header_hash)


def _stage_sources(here: str, build_dir: str, files: tuple[str, ...]) -> tuple[list[str], bool]:
    """The family's sources and every kernel header, copied into `build_dir/src` where
    their bytes differ (anything else there removed: a header the package dropped must
    not keep a build working), and the copies' paths, with whether any copy changed.
    ninja keys its build on the sources' paths and mtimes: compiled from the package
    directory, a second checkout or a reinstall of the same kernels into another path
    rebuilt them (minutes); compiled from these copies, unchanged kernels reuse the
    cached build wherever the package lives. The caller holds the build directory's lock."""
    src = os.path.join(build_dir, "src")
    os.makedirs(src, exist_ok=True)
    headers = sorted(f for f in os.listdir(here) if f.endswith(".h"))
    wanted = {*files, *headers}
    for name in os.listdir(src):
        if name not in wanted:
            os.remove(os.path.join(src, name))
    changed = False
    for name in sorted(wanted):
        with open(os.path.join(here, name), "rb") as f:
            data = f.read()
        target = os.path.join(src, name)
        try:
            with open(target, "rb") as f:
                if f.read() == data:
                    continue  # untouched: its mtime stays, and ninja sees nothing new
        except FileNotFoundError:
            pass
        partial = f"{target}.{os.getpid()}.tmp"
        with open(partial, "wb") as f:
            f.write(data)
        os.replace(partial, target)
        changed = True
    return [os.path.join(src, name) for name in files], changed


def _headers_hash(here: str) -> str:
    digest = hashlib.sha256()
    for name in sorted(f for f in os.listdir(here) if f.endswith(".h")):
        with open(os.path.join(here, name), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


def _build(
    name: str, build_dir: str, sources: list[str], isa_flags: list[str], header_hash: str
) -> ModuleType | None:
    from torch.utils.cpp_extension import load

    try:
        return load(
            name=name,
            sources=sources,
            extra_cflags=[
                "-O3",
                *isa_flags,
                "-fopenmp",
                "-ffast-math",
                f"-DMINIVLLM_KERNELS_H={header_hash}",
            ],
            extra_ldflags=["-fopenmp"],
            build_directory=build_dir,
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 (any build failure means: use the fallback)
        logger.warning("CPU kernels unavailable, using stock PyTorch linears (%s)", exc)
        return None
