"""Quantized weights on transparent huge pages (2 MiB).

Batch-1 decode on CPU streams every weight from memory each step, through 4 KiB pages by
default: for the int4 Qwen3-0.6B shape ~75,000 page walks a step, and the hardware
prefetchers stop at every 4 KiB boundary. Most Linux distributions ship THP in "madvise"
mode, where a range gets huge pages only if asked, and a quantized linear's tensors
(1-3 MiB each at that shape) seldom cover a whole aligned 2 MiB page anyway. So the
quantized methods copy their tensors, once at load, into `HugePageArena` chunks: 64 MiB
anonymous mappings advised MADV_HUGEPAGE, filled one tensor after another.

Measured on a 2-vCPU AMD EPYC (Zen 4), the same data on either kind of page, in one
process (docs/performance.md, item 21): the int4 row kernel over the model's four linear
shapes 1.08x, bf16's GEMV 1.02x. Moving bf16 weights there after the load cost 1.2-2.7 s
of start-up (MADV_COLLAPSE, or a second copy) for those 2%; since session 6 of 2026-12-05
the loader fills every linear weight on a huge-page mapping of its own from the start
(`utils/memory.own_mapping_empty`, `mapping` below), which made the load no slower and often
faster: the checkpoint's copy into 2 MiB pages takes 512 times fewer page faults (the
Qwen3-4B shape's load, alternated runs on the Zen 4 VM: bf16 7.1-10.1 -> 5.7-6.3 s, int8
7.3-9.3 -> 5.7-6.6 s with memory free; level, int8 7.8-9.1 -> 7.8-8.4 s, once the page
cache held 19 of 24 GB and huge pages had to be reclaimed first). The KV cache stays on
small pages: its first write to each 2 MiB would zero the whole page, and a request touches one in every KV head of
every layer (~2.5 s on the first request at this shape).

Advice is a hint: where the kernel has no huge page to give, or THP is "never", the
arena's pages are ordinary ones and nothing else changes. MINIVLLM_HUGE_PAGES=0 skips it.
"""

from __future__ import annotations

import mmap
import os
import sys
import time
import weakref

import torch

HUGE_PAGE_BYTES = 2 << 20
HUGE_PAGES_ENV = "MINIVLLM_HUGE_PAGES"
CHUNK_BYTES = 64 << 20
ALIGN = 64  # bytes: a cache line, and the AVX-512 kernels' vector


def enabled() -> bool:
    return (
        sys.platform.startswith("linux")
        and hasattr(mmap, "MADV_HUGEPAGE")
        and os.environ.get(HUGE_PAGES_ENV, "1") != "0"
    )


def mapping(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of `nbytes` on an anonymous mapping of its own, starting on a 2 MiB
    boundary (2 MiB more are mapped for that; pages never touched cost nothing), its whole
    2 MiB pages advised MADV_HUGEPAGE; a partial last one stays on small pages (a huge page
    there would fault in up to 2 MiB past the tensor). Unmapped when the last view goes."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` mapped
    start = -whole.data_ptr() % HUGE_PAGE_BYTES  # the first 2 MiB boundary
    if nbytes >= HUGE_PAGE_BYTES:
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
    return whole[start : start + nbytes]


class HugePageArena:
    """Copies of tensors packed into huge-page-advised chunks; a chunk is unmapped when
    the last tensor in it is gone. Tensors over a chunk get a mapping of their own."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None  # uint8 view of the current chunk
        self._used = 0
        self.bytes_placed = 0
        self.seconds = 0.0  # spent mapping and copying
        # the tensors `empty` gave out, by id: `copy` leaves them where they are
        self._given: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`'s copy in the arena (contiguous), or `tensor` itself where huge pages
        are off, it is not a CPU tensor, or the arena's `empty` made it."""
        if not enabled() or tensor.device.type != "cpu" or tensor.numel() == 0:
            return tensor
        if self._given.get(id(tensor)) is tensor:
            return tensor
        start = time.perf_counter()
        out = self._room(tensor.shape, tensor.dtype)
        out.copy_(tensor)
        self.seconds += time.perf_counter() - start
        return out

    def empty(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """An uninitialised tensor in the arena (`torch.empty` where huge pages are off or
        `device` is not the CPU), for tensors built piece by piece (quantized MoE experts,
        one expert at a time; a large weight quantized a chunk of rows at a time), which
        `copy` then leaves in place."""
        if not enabled() or torch.device(device).type != "cpu" or not all(shape):
            return torch.empty(shape, dtype=dtype, device=device)
        out = self._room(shape, dtype)
        self._given[id(out)] = out
        return out

    def _room(self, shape, dtype: torch.dtype) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if nbytes > self.chunk_bytes:
            room = mapping(nbytes)
        else:
            offset = -(-self._used // ALIGN) * ALIGN
            if self._chunk is None or offset + nbytes > self._chunk.numel():
                self._chunk, offset = mapping(self.chunk_bytes), 0
            room = self._chunk[offset:]
            self._used = offset + nbytes
        self.bytes_placed += nbytes
        return room[:nbytes].view(dtype).view(shape)


_weights_arena = HugePageArena()


def weights_arena() -> HugePageArena:
    """The process's arena for quantized weights (QuantizedLinearMethod.install)."""
    return _weights_arena
