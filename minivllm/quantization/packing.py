"""Copies of quantized weights in the layouts our batched GEMMs read, made once at load.

`formats.QuantWeights` keeps the weight in its scheme's row layout (what `quant_linear`
streams and `reference_linear` defines); the GEMMs for batches read a second layout,
filled into `qw.packed` here: int8_w8a8's AMX blocks (`pack_amx_w8a8`, amx_w8a8.cpp) or
VNNI panels (`pack_vnni_w8a8`, quant_w8a8.cpp), and int4_w4a8's VNNI panels
(`pack_vnni_w4a8`, int4_w4a8.cpp). `kernel_limits.packed_layout` tells the two int8 ones apart.
Where VNNI panels serve every call the row copy is dropped (`drop_rows`) and rebuilt from
the panels only for an engine that reads rows (`with_rows`); the layers hold the copies
as buffers, so the weight cache serves them as they are (`prepack`'s `mapped`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

from minivllm.quantization.formats import (
    INT4_SCHEMES,
    INT4_SYMMETRIC_ZERO,
    QuantWeights,
    pack_int4,
    unpack_int4,
)

AMX_BLOCK_N, AMX_BLOCK_K = 32, 64  # output rows per weight block, int8 k per tile row
VNNI_PANEL = 32  # output rows per panel of pack_vnni_w8a8's layout
PACKED_LAYOUTS = ("amx", "vnni")


def packed_shape(qw: QuantWeights, layout: str) -> tuple[int, ...]:
    """The shape of `qw`'s copy in `layout` ("amx" or "vnni" for int8_w8a8, "w4a8" for
    int4_w4a8's panels): what a copy the weight cache mapped must be to stand in for one
    packed here."""
    n, k = qw.out_features, qw.in_features
    if layout == "amx":
        return (-(-n // AMX_BLOCK_N), -(-k // AMX_BLOCK_K), 2, 16, 64)
    if layout == "vnni":
        return (-(-n // VNNI_PANEL), k // 4, VNNI_PANEL, 4)
    if layout == "w4a8":
        return (-(-n // W4A8_PANEL), k // 8 * 64 + k // qw.group_size * 128)
    raise ValueError(f"packed layout must be one of {PACKED_LAYOUTS + ('w4a8',)}, got {layout!r}")


def fits(mapped: Tensor | None, qw: QuantWeights, layout: str) -> bool:
    """Whether `mapped` is a copy of `qw` in `layout` by shape and dtype."""
    dtype = torch.uint8 if layout == "w4a8" else torch.int8
    return (
        mapped is not None
        and tuple(mapped.shape) == packed_shape(qw, layout)
        and mapped.dtype == dtype
    )


def prepack(
    qw: QuantWeights,
    layout: str,
    mapped: Tensor | None = None,
    empty: Callable[[tuple[int, ...], torch.dtype], Tensor] | None = None,
    kernels: Callable[[str], Callable[..., None] | None] | None = None,
) -> None:
    """Fill `qw.packed` in `layout` (`packed_shape`'s): with `mapped` where it is a copy of
    that shape and dtype (the weight cache's, packed by the daemon from the same weights:
    the cache key matched), else packed here into `empty(shape, dtype)` (default
    `torch.empty`; the huge-page arena's where the copy lives there), `PACK_CHUNK` bytes of
    rows at a time so that the packing's temporaries stay small whatever the layer (an LM
    head's are hundreds of MB). `kernels`: the engine's `Kernels.op`, whose compiled
    packers (kernels/pack_weights.cpp, `PACK_OPS`) fill the layout in one pass with no
    temporaries, byte for byte these functions' (tests/test_pack_weights.py)."""
    if fits(mapped, qw, layout):
        qw.packed = mapped
        return
    if not qw.has_rows:
        raise ValueError(
            f"an {qw.scheme} layer of [{qw.out_features}, {qw.in_features}] came without its "
            "rows and without panels of its shape; restart the weight cache daemon with "
            "this engine's settings"
        )
    if layout == "w4a8":
        if qw.scheme != "int4_w4a8":
            raise ValueError(f"w4a8 panels pack int4_w4a8 weights, not {qw.scheme}")
        pack, panel = pack_vnni_w4a8, W4A8_PANEL
    elif qw.scheme != "int8_w8a8":
        raise ValueError(f"only int8_w8a8 weights are prepacked, not {qw.scheme}")
    elif layout in PACKED_LAYOUTS:
        pack = (
            (lambda part: pack_amx_w8a8(part.weight))
            if layout == "amx"
            else (lambda part: pack_vnni_w8a8(part.weight))
        )
        panel = AMX_BLOCK_N if layout == "amx" else VNNI_PANEL
    else:
        raise ValueError(f"packed layout must be one of {PACKED_LAYOUTS}, got {layout!r}")
    shape = packed_shape(qw, layout)
    dtype = torch.uint8 if layout == "w4a8" else torch.int8
    out = (
        empty(shape, dtype)
        if empty is not None
        else torch.empty(shape, dtype=dtype, device=qw.weight.device)
    )
    op = kernels(PACK_OPS[layout]) if kernels is not None else None
    if op is not None and qw.weight.device.type == "cpu" and qw.in_features % 4 == 0:
        if layout == "w4a8":
            zero = None if qw.zero is None else qw.zero.contiguous()
            op(qw.weight.contiguous(), qw.scale.contiguous(), zero, qw.group_size, out)
        else:
            op(qw.weight.contiguous(), out)
        qw.packed = out
        return
    n = qw.out_features
    rows = max(1, PACK_CHUNK // max(qw.weight.nbytes // max(n, 1), 1) // panel) * panel
    for start in range(0, n, rows):
        part = pack(_row_slice(qw, start, min(start + rows, n)))
        out[start // panel : start // panel + len(part)].copy_(part)
    qw.packed = out


PACK_CHUNK = 4 << 20  # bytes of rows packed at a time
# the compiled packer of each layout (kernels/pack_weights.cpp)
PACK_OPS = {"vnni": "pack_vnni_w8a8", "amx": "pack_amx_w8a8", "w4a8": "pack_vnni_w4a8"}


def prepack_w4a8(qw: QuantWeights) -> None:
    """Fill `qw.packed` with int4_w4a8's panels (`pack_vnni_w4a8`) for its VNNI GEMM."""
    prepack(qw, "w4a8")


def prepack_w8a8(qw: QuantWeights, layout: str) -> None:
    """Fill `qw.packed` with a copy of the int8 weight for large batches in `layout`: our
    AMX kernel's (`pack_amx_w8a8`) or our VNNI GEMM's (`pack_vnni_w8a8`)."""
    if layout not in PACKED_LAYOUTS:
        raise ValueError(f"packed layout must be one of {PACKED_LAYOUTS}, got {layout!r}")
    prepack(qw, layout)


def _row_slice(qw: QuantWeights, start: int, stop: int) -> QuantWeights:
    """Rows [start, stop) of `qw` (the packings are per row; each panel's rows pack alone)."""

    def rows(t: Tensor | None) -> Tensor | None:
        return None if t is None else t[start:stop]

    return dataclasses.replace(
        qw,
        weight=qw.weight[start:stop],
        scale=rows(qw.scale),
        zero=rows(qw.zero),
        wsum=rows(qw.wsum),
        out_features=stop - start,
        packed=None,
    )


W4A8_PANEL = 16  # weight rows per panel of pack_vnni_w4a8


def pack_vnni_w4a8(qw: QuantWeights) -> Tensor:
    """int4 weights in the layout int4_w4a8.cpp's panel GEMM reads: uint8 [ceil(N/16),
    K/8 * 64 + groups * 128]. Panel p holds rows n = 16p + i (zeros past N): per 8 k, 64
    bytes, byte 4i + j = q[n, 8s + j] | q[n, 8s + 4 + j] << 4 (one vpdpbusd multiplies the
    low nibbles, k 8s .. 8s + 3 of 16 rows, by 4 broadcast bytes of x; the high ones the
    next 4 k); then the panel's scales and zero points (8 where symmetric) as float32
    [groups, 16] each. A copy made at load (`qw.packed`), as int8_w8a8's."""
    if qw.scheme not in INT4_SCHEMES:
        raise ValueError(f"pack_vnni_w4a8 packs int4 weights, not {qw.scheme}")
    n, k, groups = qw.out_features, qw.in_features, qw.in_features // qw.group_size
    if k % 8:
        raise ValueError(f"pack_vnni_w4a8 needs K a multiple of 8, got {k}")
    pad = -n % W4A8_PANEL
    q = torch.nn.functional.pad(unpack_int4(qw.weight), (0, 0, 0, pad))
    q = q.view(-1, W4A8_PANEL, k // 8, 2, 4).permute(0, 2, 1, 3, 4)  # p s i half j
    weights = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(q.shape[0], -1)
    zero = torch.full_like(qw.scale, INT4_SYMMETRIC_ZERO) if qw.zero is None else qw.zero

    def per_panel(t: Tensor) -> Tensor:  # [N, groups] -> bytes of [panels, groups, 16]
        t = torch.nn.functional.pad(t.to(torch.float32), (0, 0, 0, pad))
        t = t.view(-1, W4A8_PANEL, groups).transpose(1, 2).contiguous()
        return t.view(t.shape[0], -1).view(torch.uint8)

    return torch.cat((weights, per_panel(qw.scale), per_panel(zero)), dim=1).contiguous()


def rows_of_vnni_w4a8(packed: Tensor, qw: QuantWeights) -> Tensor:
    """The int4 rows (formats' packing, uint8 [N, K/2]) that `pack_vnni_w4a8` made `packed`
    from, for `qw`'s shape: its inverse on the nibbles, exact."""
    n, k = qw.out_features, qw.in_features
    if not fits(packed, qw, "w4a8"):
        raise ValueError(f"int4_w4a8 panels of shape {tuple(packed.shape)} do not fit [{n}, {k}]")
    panels = packed.shape[0]
    nibbles = packed[:, : k // 8 * 64].reshape(panels, k // 8, W4A8_PANEL, 4)  # p s i j
    q = torch.stack((nibbles & 0xF, nibbles >> 4), dim=3)  # p s i half j
    q = q.permute(0, 2, 1, 3, 4).reshape(panels * W4A8_PANEL, k)[:n]
    return pack_int4(q.contiguous())


def drop_rows(qw: QuantWeights) -> QuantWeights:
    """`qw` without its row copy of the weight (`weight` [N, 0]), where its prepacked copy
    (`qw.packed`: int4_w4a8's panels, int8_w8a8's VNNI panels) serves every call: the rows
    would be a second copy nothing reads. Scales, zero points and row sums stay."""
    if qw.packed is None or not (
        qw.scheme == "int4_w4a8" or (qw.scheme == "int8_w8a8" and qw.packed.dim() == 4)
    ):
        raise ValueError(
            "only int4_w4a8 and int8_w8a8 weights with their VNNI panels can drop their rows"
        )
    empty = torch.empty(qw.out_features, 0, dtype=qw.weight.dtype, device=qw.weight.device)
    return dataclasses.replace(qw, weight=empty)


def with_rows(qw: QuantWeights, panels: Tensor | None) -> QuantWeights:
    """`qw` with its row copy of the weight, rebuilt from its VNNI `panels` where it has
    none (an engine that reads rows, such as one on the reference backend, mapping a
    rowless layer from the weight cache); exact."""
    if qw.has_rows:
        return qw
    if panels is None:
        raise ValueError(
            f"an {qw.scheme} layer came without its rows and without the panels that hold "
            "them; restart the weight cache daemon with this engine's settings"
        )
    rows = (
        rows_of_vnni_w4a8(panels, qw) if qw.scheme == "int4_w4a8" else rows_of_vnni_w8a8(panels, qw)
    )
    return dataclasses.replace(qw, weight=rows, packed=None)


def rows_of_vnni_w8a8(packed: Tensor, qw: QuantWeights) -> Tensor:
    """The int8 rows [N, K] that `pack_vnni_w8a8` made `packed` from: its inverse, exact."""
    n, k = qw.out_features, qw.in_features
    if not fits(packed, qw, "vnni"):
        raise ValueError(f"int8_w8a8 panels of shape {tuple(packed.shape)} do not fit [{n}, {k}]")
    return packed.permute(0, 2, 1, 3).reshape(-1, k)[:n].contiguous()


def pack_amx_w8a8(q: Tensor) -> Tensor:
    """int8 q [N, K] in the layout amx_w8a8.cpp's tiles load: [N/32, K/64, 2, 16, 64], zero-
    padded to whole blocks. Block b, k-block kb, half j holds rows n = 32b + 16j + c (c < 16)
    and k = 64kb + 4i + e as byte [i, 4c + e]: TDPBSSD's B operand, 4 k per 32-bit lane."""
    n, k = q.shape
    n_pad, k_pad = -n % AMX_BLOCK_N, -k % AMX_BLOCK_K
    padded = torch.nn.functional.pad(q, (0, k_pad, 0, n_pad))
    blocks = padded.view((n + n_pad) // 32, 2, 16, (k + k_pad) // 64, 16, 4)  # b j c kb i e
    return blocks.permute(0, 3, 1, 4, 2, 5).contiguous().view(-1, (k + k_pad) // 64, 2, 16, 64)


def pack_vnni_w8a8(q: Tensor) -> Tensor:
    """int8 q [N, K] (K a multiple of 4) in the layout quant_w8a8.cpp's VNNI GEMM reads:
    [N/32, K/4, 32, 4], zero-padded to whole panels. Panel p holds rows n = 32p + c as
    byte [k / 4, c, k % 4]: the 4 k of 32 rows that one step multiplies are 128 bytes."""
    n, k = q.shape
    if k % 4:
        raise ValueError(f"pack_vnni_w8a8 needs K a multiple of 4, got {k}")
    padded = torch.nn.functional.pad(q, (0, 0, 0, -n % VNNI_PANEL))
    panels = padded.view(-1, VNNI_PANEL, k // 4, 4)  # p c kq e
    return panels.permute(0, 2, 1, 3).contiguous()
