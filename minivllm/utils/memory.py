"""Memory probes: what the host (or the GPU) can give the KV cache and prepacked weights."""

from __future__ import annotations

import os
import sys

import torch


def default_kv_cache_bytes(device: str, model_bytes: int) -> int:
    """A sane share of free memory: a quarter of available RAM on CPU, 90% of free GPU memory
    minus headroom on CUDA. `model_bytes` is already resident, so it is not subtracted again."""
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        return max(int(free * 0.9) - (1 << 30), 1 << 26)
    return max(available_host_bytes() // 4, 1 << 26)


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo, else the free pages sysconf reports."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


# glibc's mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # the largest glibc accepts on 64-bit
_TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int
MALLOC_TUNING_ENV = "MINIVLLM_CPU_MALLOC_TUNING"


def keep_freed_host_memory() -> bool:
    """Ask glibc to keep freed activation memory for reuse instead of handing it back to
    the kernel after every step: each forward frees and reallocates tens to hundreds of
    MB of activations, and by default glibc unmaps or trims them, so the next step
    faults every page in again (and the kernel zeroes it). A 64 x 256-token prefill of
    the Qwen3-0.6B shape took 4.7 M minor page faults without this and 0.19 M with it
    (docs/performance.md). vLLM's CPU backend gets the same from tcmalloc; this is the
    in-process equivalent (mmap threshold fixed at 32 MiB, trim threshold 2 GiB), so
    the process's resident memory stays at its peak. Linux with glibc only; opt out
    with MINIVLLM_CPU_MALLOC_TUNING=0. Returns whether it was applied."""
    if os.environ.get(MALLOC_TUNING_ENV, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    return bool(
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
        and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    )


def release_freed_host_memory() -> bool:
    """Hand the heap's free pages back to the kernel (glibc's malloc_trim), once a load is
    processed: `keep_freed_host_memory`'s thresholds would otherwise keep every
    full-precision weight that online quantization freed, and the process would stay at
    the load's peak. Linux with glibc only; returns whether anything was released."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    return bool(trim(0))


def own_mapping_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor on the default device; on a Linux CPU, on an anonymous
    mapping of its own, unmapped as soon as the last reference to it goes: memory held only
    for a while (a full-precision weight until it is quantized or repacked) that must go
    back to the kernel, not to the heap (`keep_freed_host_memory` keeps what the heap
    frees). From 2 MiB it is a huge-page mapping (utils/huge_pages.mapping, unless
    MINIVLLM_HUGE_PAGES=0): the checkpoint's copy into it faults 2 MiB pages in instead of
    4 KiB ones (a 4B load here up to a third faster, level when the page cache has
    taken most of memory and huge pages must be reclaimed first). Elsewhere `torch.empty`."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    cpu = torch.get_default_device().type == "cpu"
    if not cpu or not sys.platform.startswith("linux") or nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    import mmap

    from minivllm.utils import huge_pages

    if nbytes >= huge_pages.HUGE_PAGE_BYTES and huge_pages.enabled():
        return huge_pages.mapping(nbytes).view(dtype).view(shape)

    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(region, dtype=dtype).view(shape)  # keeps `region` mapped
