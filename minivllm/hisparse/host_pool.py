"""The host tier: one allocation holding, for every MLA layer, host blocks of latent rows
and indexer-key rows.

Layout (one layer after another; `layer_stride` bytes each):

    layer 0: latent [num_blocks * block_size, latent_dim] | index [num_blocks * block_size, index_dim]
    layer 1: ...

Each layer's views start at `base + layer * layer_stride`. vLLM #57019 shipped garbage
tokens because packed layers were all bound at the base offset; `tests/test_hisparse.py`
runs a multi-layer model with host-backed requests to catch exactly that.

Backing: plain RAM by default; a memory-mapped file when `path` is given (a disk file, so
contexts can outgrow RAM; or a file in /dev/shm that the TP ranks of one node share).
"""

from __future__ import annotations

import os

import torch


class HostKVPool:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        latent_dim: int,
        index_dim: int,
        dtype: torch.dtype,
        path: str | None = None,
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.latent_dim, self.index_dim = latent_dim, index_dim
        rows = num_blocks * block_size
        self.layer_elems = rows * (latent_dim + index_dim)
        numel = num_layers * self.layer_elems
        self.path = path
        if path is None:
            self.storage = torch.empty(numel, dtype=dtype)
        else:
            nbytes = numel * dtype.itemsize
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if os.fstat(fd).st_size != nbytes:
                    os.ftruncate(fd, nbytes)  # sparse: pages cost disk/RAM once written
            finally:
                os.close(fd)
            self.storage = torch.from_file(path, shared=True, size=numel, dtype=dtype)
        self.num_layers = num_layers

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    def latent(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s latent rows, [num_blocks * block_size, latent_dim]."""
        base = layer * self.layer_elems
        rows = self.num_blocks * self.block_size
        return self.storage[base : base + rows * self.latent_dim].view(rows, self.latent_dim)

    def index(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s indexer-key rows, [num_blocks * block_size, index_dim]."""
        rows = self.num_blocks * self.block_size
        base = layer * self.layer_elems + rows * self.latent_dim
        return self.storage[base : base + rows * self.index_dim].view(rows, self.index_dim)

    def unlink(self) -> None:
        """Remove the backing file's name (mappings stay valid until dropped)."""
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
