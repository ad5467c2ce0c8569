"""int4_w4a8's VNNI GEMM on its prepacked panels (kernels/int4_w4a8.cpp) against
formats.reference_linear: x rounded to int8 per row and group, then the exact product with
the int4 weight, in float64.

The kernel sums each group's integers exactly (int32 lanes; the zero point's part, z times
the group's sum of xq, taken off in fp32 where every value is an integer below 2^24) and
then works in float32: xs * ws rounded once, that times the exact sum rounded, the groups'
terms added in order, the bias added, the total rounded to bf16. Each float32 step moves a
partial sum by at most 2^-24 of itself, so the output before its bf16 rounding is within
(groups + 3) 2^-24 sum_g |xs ws S_g| (+ |bias|) of the exact value, which is at most
(K + 3) 2^-24 sum_k |x_k| |w_k| with the rounded x and the dequantized w; the bf16 rounding
then adds 2^-9 of the result. The bound below takes 2^-8 of |ref| for the bf16 roundings of
both sides and K 2^-23 of the terms: generous by the factor of two."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from minivllm.kernels import get_cpu_kernels
from minivllm.kernels.isa import cpu_flags
from minivllm.quantization import formats, packing

needs_vnni = pytest.mark.skipif(
    not {"avx512_bf16", "avx512_vnni"} <= cpu_flags(), reason="CPU lacks AVX512-BF16/VNNI"
)


def _rounded_x(x: torch.Tensor, group: int) -> torch.Tensor:
    xq, xs = formats.quantize_per_group(x, group)
    return xq.double() * xs.double().repeat_interleave(group, -1)


def _within_bound(got, x, qw, bias) -> tuple[torch.Tensor, torch.Tensor]:
    ref = formats.reference_linear(x, qw, bias).double()
    terms = _rounded_x(x, qw.group_size).abs() @ formats.dequantize(qw).double().abs().T
    if bias is not None:
        terms = terms + bias.double().abs()
    bound = 2**-8 * ref.abs() + qw.in_features * 2**-23 * terms
    return (got.double() - ref).abs(), bound


def test_pack_vnni_w4a8_puts_each_weight_where_the_gemm_reads_it():
    """Decoded by hand from the layout the module documents: panel p, 8-k step s, row i,
    byte j holds k 8s + j (low nibble) and 8s + 4 + j (high); then [groups, 16] scales and
    zero points, rows past N zero."""
    n, k, group = 21, 64, 32
    gen = torch.Generator().manual_seed(0)
    qw = formats.quantize(torch.randn(n, k, generator=gen), "int4_w4a8", group, symmetric=False)
    packed = packing.pack_vnni_w4a8(qw)
    assert packed.dtype == torch.uint8 and packed.shape == (2, k // 8 * 64 + (k // group) * 128)
    q = formats.unpack_int4(qw.weight)
    for p in range(2):
        weights = packed[p, : k // 8 * 64].view(k // 8, 16, 4)
        meta = packed[p, k // 8 * 64 :].view(torch.float32).view(2, k // group, 16)
        for i in range(16):
            row = 16 * p + i
            for s in range(k // 8):
                for j in range(4):
                    byte = int(weights[s, i, j])
                    want = (
                        (0, 0) if row >= n else (int(q[row, 8 * s + j]), int(q[row, 8 * s + 4 + j]))
                    )
                    assert (byte & 0xF, byte >> 4) == want
            for g in range(k // group):
                want_s = 0.0 if row >= n else float(qw.scale[row, g])
                want_z = 0.0 if row >= n else float(qw.zero[row, g])
                assert (float(meta[0, g, i]), float(meta[1, g, i])) == (want_s, want_z)
    symmetric = formats.quantize(torch.randn(16, 64, generator=gen), "int4_w4a8", 32)
    meta = packing.pack_vnni_w4a8(symmetric)[0, 8 * 64 :].view(torch.float32).view(2, 2, 16)
    assert bool((meta[1] == formats.INT4_SYMMETRIC_ZERO).all())
    with pytest.raises(ValueError, match="int4"):
        packing.pack_vnni_w4a8(formats.quantize(torch.randn(16, 64), "int8_w8a8"))


@pytest.mark.parametrize("n,k,group", [(21, 64, 32), (16, 128, 64), (300, 512, 128)])
def test_rows_rebuilt_from_the_panels_are_the_rows_packed(n, k, group):
    """int4_w4a8 on its panels drops its row copy (`packing.drop_rows`); an engine that
    reads rows rebuilds them from the panels (`packing.with_rows`): the same bytes, for a
    partial last panel too; and no rows and no panels is an error that says what to do."""
    gen = torch.Generator().manual_seed(n)
    qw = formats.quantize(torch.randn(n, k, generator=gen), "int4_w4a8", group, symmetric=False)
    packing.prepack_w4a8(qw)
    rowless = packing.drop_rows(qw)
    assert not rowless.has_rows and rowless.weight.shape == (n, 0) and qw.has_rows
    rebuilt = packing.with_rows(rowless, qw.packed)
    assert torch.equal(rebuilt.weight, qw.weight) and rebuilt.has_rows
    assert packing.with_rows(qw, None) is qw  # rows already there
    with pytest.raises(ValueError, match="restart the weight cache daemon"):
        packing.with_rows(rowless, None)
    with pytest.raises(ValueError, match="restart the weight cache daemon"):
        packing.prepack(packing.drop_rows(qw), "w4a8", qw.packed[:, 1:])  # panels of another shape
    with pytest.raises(ValueError, match="do not fit"):
        packing.rows_of_vnni_w4a8(qw.packed[1:], qw)
    # int8_w8a8 on VNNI panels likewise
    q8 = formats.quantize(torch.randn(n, k, generator=gen), "int8_w8a8")
    packing.prepack(q8, "vnni")
    rowless8 = packing.drop_rows(q8)
    assert not rowless8.has_rows and rowless8.weight.dtype == torch.int8
    assert torch.equal(packing.with_rows(rowless8, q8.packed).weight, q8.weight)
    with pytest.raises(ValueError, match="VNNI panels"):
        packing.drop_rows(dataclasses.replace(q8, packed=packing.pack_amx_w8a8(q8.weight)))


@needs_vnni
@pytest.mark.parametrize(
    "m,n,k,group,symmetric",
    [
        (1, 37, 1024, 128, True),  # decode; 37 rows: a partial last panel
        (1, 300, 512, 128, False),  # decode's runs of 8 panels, then the 3 left one at a time
        (2, 200, 256, 64, True),  # runs of 6 panels
        (2, 40, 512, 64, False),
        (3, 16, 256, 32, True),
        (4, 100, 1024, 256, False),
        (5, 33, 768, 128, True),  # the 12-row tiles from 5 rows
        (13, 200, 384, 128, False),  # a full tile and one row
        (30, 48, 2048, 512, True),
        (50, 20, 8192, 128, False),  # past the chunk of x rows (384 KB / K = 48 rows)
    ],
)
def test_int4_w4a8_gemm_matches_the_reference(m, n, k, group, symmetric):
    """Within the module's bound of the reference, with and without bias; an outlier
    channel, a zero row (scale 1) and, by the same bound around the unrounded product
    failing somewhere, proof that x was rounded to int8 at all."""
    gen = torch.Generator().manual_seed(m * 100 + group)
    qw = formats.quantize(torch.randn(n, k, generator=gen), "int4_w4a8", group, symmetric)
    packing.prepack_w4a8(qw)
    x = torch.randn(m, k, generator=gen).bfloat16()
    x[:, :8] *= 30
    x[0, : 2 * group] = 0.0  # two groups of zeros
    bias = torch.randn(n, generator=gen).bfloat16()
    kernels = get_cpu_kernels()
    for b in (None, bias):
        got = kernels.int4_w4a8_packed_linear(x, qw.packed, n, group, b)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        err, bound = _within_bound(got, x, qw, b)
        assert (err <= bound).all(), err.max()
    unrounded = x.double() @ formats.dequantize(qw).double().T + bias.double()
    assert ((got.double() - unrounded).abs() > bound).any()


@needs_vnni
def test_int4_w4a8_gemm_carries_inf_and_nan_to_their_rows():
    """A group holding an inf or NaN has scale NaN (formats.quantize_per_group's amax): its
    row's outputs are NaN, the other rows are untouched."""
    qw = formats.quantize(torch.randn(24, 256), "int4_w4a8", 128)
    packing.prepack_w4a8(qw)
    x = torch.randn(3, 256).bfloat16()
    x[1, 5] = float("inf")
    x[2, 200] = float("nan")
    got = get_cpu_kernels().int4_w4a8_packed_linear(x, qw.packed, 24, 128, None)
    assert bool(got[1:].isnan().all())
    err, bound = _within_bound(got[:1], x[:1], qw, None)
    assert (err <= bound).all()


@needs_vnni
def test_int4_w4a8_gemm_rejects_mismatched_inputs():
    kernels = get_cpu_kernels()
    qw = formats.quantize(torch.randn(24, 256), "int4_w4a8", 128)
    packing.prepack_w4a8(qw)
    x = torch.randn(2, 256).bfloat16()
    with pytest.raises(RuntimeError, match="group_size"):
        kernels.int4_w4a8_packed_linear(x, qw.packed, 24, 48, None)
    with pytest.raises(RuntimeError, match="packed"):
        kernels.int4_w4a8_packed_linear(x, qw.packed, 40, 128, None)
    with pytest.raises(RuntimeError, match="packed"):
        kernels.int4_w4a8_packed_linear(torch.randn(2, 128).bfloat16(), qw.packed, 24, 128, None)
    with pytest.raises(RuntimeError, match="bias"):
        kernels.int4_w4a8_packed_linear(x, qw.packed, 24, 128, torch.ones(3).bfloat16())
    with pytest.raises(RuntimeError, match="bf16"):
        kernels.int4_w4a8_packed_linear(x.float(), qw.packed, 24, 128, None)
