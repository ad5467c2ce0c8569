"""The daemon's weights in one sealed memfd, and the tensors an engine maps from it.

    memfd (sealed: no write, no resize)
    | storage 0 | pad | storage 1 | pad | ...        each storage 64-byte aligned
      ^ byte_offset of every tensor viewing storage 0

Every unique storage of the model's parameters and buffers is written once; each
tensor is an entry (name, kind, dtype, shape, stride, storage_offset, segment,
byte_offset), and a second name for the same tensor (tied embeddings, a rotary
table shared by all layers) is an alias. Once written the memfd is sealed against
writes, so no engine (nor the daemon) can change weights another engine maps.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

_ALIGN = 64
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
        torch.bool,
    )
}
_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


@dataclass(slots=True)
class TensorEntry:
    name: str
    kind: str  # "param" | "buffer"
    dtype: str
    shape: list[int]
    stride: list[int]
    storage_offset: int  # elements, as torch counts them
    segment: int  # index into the fds sent with the manifest
    byte_offset: int  # where the tensor's storage starts in the segment
    storage_bytes: int

    @classmethod
    def from_json(cls, data: Any) -> TensorEntry:
        try:
            entry = cls(**data)
        except TypeError as e:
            raise ValueError(f"malformed manifest entry: {e}") from None
        if entry.kind not in ("param", "buffer") or entry.dtype not in _DTYPES:
            raise ValueError(f"manifest entry {entry.name!r}: bad kind or dtype")
        if len(entry.shape) != len(entry.stride) or min([entry.byte_offset, *entry.shape]) < 0:
            raise ValueError(f"manifest entry {entry.name!r}: bad shape or offsets")
        return entry


def named_tensors(model: nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    """(name, kind, tensor) for every parameter and buffer, duplicates (tied names) kept."""
    params = [(n, "param", p) for n, p in model.named_parameters(remove_duplicate=False)]
    buffers = [(n, "buffer", b) for n, b in model.named_buffers(remove_duplicate=False)]
    return params + buffers


# names of a speculative draft's tensors in the manifest: "draft:" + the draft model's name
# (no module path has a colon, so the two models' names cannot meet)
DRAFT_PREFIX = "draft:"


class WeightArena:
    """The daemon side: a sealed memfd holding a model's tensors (and its speculative
    draft's, under `DRAFT_PREFIX`), and their manifest."""

    def __init__(self, model: nn.Module, draft: nn.Module | None = None) -> None:
        self.entries: list[TensorEntry] = []
        self.aliases: dict[str, str] = {}
        tensors = named_tensors(model)
        if draft is not None:
            tensors += [(DRAFT_PREFIX + n, k, t) for n, k, t in named_tensors(draft)]
        canonical: dict[int, str] = {}  # id(tensor) -> its first name
        storages: dict[int, tuple[torch.UntypedStorage, int]] = {}  # data_ptr -> offset
        size = 0
        for name, _, tensor in tensors:
            if id(tensor) in canonical:
                continue
            canonical[id(tensor)] = name
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in storages:
                storages[storage.data_ptr()] = (storage, size)
                size += -(-storage.nbytes() // _ALIGN) * _ALIGN
        self.size = max(size, _ALIGN)
        self.fd = os.memfd_create("minivllm-weights", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, self.size)
        for storage, offset in storages.values():
            _pwrite_all(self.fd, storage, offset)
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
        for name, kind, tensor in tensors:
            first = canonical[id(tensor)]
            if first != name:
                self.aliases[name] = first
                continue
            storage, offset = storages[tensor.untyped_storage().data_ptr()]
            self.entries.append(
                TensorEntry(
                    name=name,
                    kind=kind,
                    dtype=str(tensor.dtype).removeprefix("torch."),
                    shape=list(tensor.shape),
                    stride=list(tensor.stride()),
                    storage_offset=tensor.storage_offset(),
                    segment=0,
                    byte_offset=offset,
                    storage_bytes=storage.nbytes(),
                )
            )

    def manifest(self) -> dict[str, Any]:
        return {
            "entries": [_entry_json(e) for e in self.entries],
            "aliases": self.aliases,
            "segment_bytes": [self.size],
        }

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _entry_json(entry: TensorEntry) -> dict[str, Any]:
    return {name: getattr(entry, name) for name in TensorEntry.__slots__}


def _pwrite_all(fd: int, storage: torch.UntypedStorage, offset: int) -> None:
    data = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done : done + (1 << 30)], offset + done)


def map_segments(fds: list[int], sizes: list[int], copy: bool) -> list[torch.Tensor]:
    """Each segment as a flat uint8 tensor: a read-only shared mapping (zero copy), or a
    private copy of it. The fds are closed here; a mapping outlives its fd."""
    if len(fds) != len(sizes):
        raise ValueError(f"{len(fds)} segment fds for {len(sizes)} segment sizes")
    out = []
    try:
        for fd, size in zip(fds, sizes):
            if os.fstat(fd).st_size < size:
                raise ValueError("a weight segment is smaller than its manifest says")
            # no MAP_POPULATE: measured on the 4B shape, filling the page tables up front
            # took weights 0.21 -> 0.55 s and restart-to-first-token 3.69 -> 4.06 s
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            with warnings.catch_warnings():  # read-only on purpose: writes would fault
                warnings.simplefilter("ignore", UserWarning)
                flat = torch.frombuffer(mapping, dtype=torch.uint8)
            out.append(flat.clone() if copy else flat)
    finally:
        for fd in fds:
            os.close(fd)
    return out


def entry_tensor(entry: TensorEntry, segments: list[torch.Tensor]) -> torch.Tensor:
    """The entry's tensor, viewing its segment with the daemon's dtype, shape and stride."""
    if not 0 <= entry.segment < len(segments):
        raise ValueError(f"manifest entry {entry.name!r} names a missing segment")
    segment = segments[entry.segment]
    end = entry.byte_offset + entry.storage_bytes
    dtype = _DTYPES[entry.dtype]
    if end > segment.numel() or entry.storage_bytes % dtype.itemsize:
        raise ValueError(f"manifest entry {entry.name!r} lies outside its segment")
    storage = segment[entry.byte_offset : end].view(dtype)
    reach = entry.storage_offset + sum((s - 1) * st for s, st in zip(entry.shape, entry.stride))
    if min([entry.storage_offset, *entry.stride]) < 0 or (
        all(entry.shape) and reach >= storage.numel()
    ):
        raise ValueError(f"manifest entry {entry.name!r} reaches past its storage")
    # as_strided counts the offset from the mapping's start, where `storage` begins later
    return storage.as_strided(
        entry.shape, entry.stride, storage.storage_offset() + entry.storage_offset
    )
