"""The host tier: one allocation holding, for every MLA layer, host blocks of latent rows
and indexer-key rows.

Layout (one layer after another):

    layer 0: latent [num_blocks * block_size, latent_dim] | index [num_blocks * block_size, index_dims[0]]
    layer 1: ...

Each layer's views start at its own offset (`layer_base`: the widths may differ, a layer
that shares another's selection keeps no indexer keys). vLLM #57019 shipped garbage
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
        index_dims: list[int],
        dtype: torch.dtype,
        path: str | None = None,
    ) -> None:
        """`index_dims`: each layer's indexer-key width (0 for a layer that shares
        another's selection and keeps no keys)."""
        if len(index_dims) != num_layers:
            raise ValueError(f"{len(index_dims)} index widths for {num_layers} layers")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.latent_dim, self.index_dims = latent_dim, list(index_dims)
        rows = num_blocks * block_size
        self.layer_base = [0]  # each layer's first element
        for dim in index_dims:
            self.layer_base.append(self.layer_base[-1] + rows * (latent_dim + dim))
        numel = self.layer_base[-1]
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
        base = self.layer_base[layer]
        rows = self.num_blocks * self.block_size
        return self.storage[base : base + rows * self.latent_dim].view(rows, self.latent_dim)

    def index(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s indexer-key rows, [num_blocks * block_size, its index width]."""
        rows, dim = self.num_blocks * self.block_size, self.index_dims[layer]
        base = self.layer_base[layer] + rows * self.latent_dim
        return self.storage[base : base + rows * dim].view(rows, dim)

    def unlink(self) -> None:
        """Remove the backing file's name (mappings stay valid until dropped)."""
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
