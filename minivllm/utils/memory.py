"""Memory probes: what the host (or the GPU) can give the KV cache and prepacked weights."""

from __future__ import annotations

import os

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
