"""int8_w8a8's GEMMs on prepacked copies of the weight (quant_w8a8.cpp's VNNI GEMM,
amx_w8a8.cpp's AMX kernel) against `reference_linear`, and the packing
layouts they read (packing.pack_vnni_w8a8, pack_amx_w8a8). The tolerance is
test_quant_kernels.py's, derived there."""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels import get_cpu_kernels
from minivllm.quantization.formats import (
    from_int8_values,
    quantize,
    reference_linear,
)
from minivllm.quantization.packing import pack_amx_w8a8, pack_vnni_w8a8, prepack_w8a8
from tests.test_quant_kernels import (
    _amx_available,
    _weights,
    assert_matches_reference,
    needs_vnni,
)

needs_amx = pytest.mark.skipif(not _amx_available(), reason="CPU (or Linux) lacks AMX-INT8")


def test_pack_amx_w8a8_puts_each_weight_where_the_tiles_read_it():
    q = torch.randint(-128, 128, (70, 150), generator=torch.Generator().manual_seed(4))
    q = q.to(torch.int8)
    packed = pack_amx_w8a8(q)
    assert packed.shape == (3, 3, 2, 16, 64)  # 70 rows -> 3 blocks of 32, 150 k -> 3 of 64
    for n, k in [(0, 0), (17, 5), (33, 64), (69, 149), (40, 127)]:
        b, j, c = n // 32, n % 32 // 16, n % 16
        assert packed[b, k // 64, j, k % 64 // 4, 4 * c + k % 4] == q[n, k]
    assert packed.flatten().abs().sum() == q.abs().sum()  # padding is zeros
    # rows 70..95 do not exist: block 2's first half from column 6 (row 70), its second half
    assert packed[2, :, 0, :, 4 * 6 :].abs().sum() == 0 and packed[2, :, 1].abs().sum() == 0


@needs_amx
def test_amx_w8a8_rejects_mismatched_inputs():
    kernels = get_cpu_kernels()
    qw = quantize(_weights(40, 128, 1), "int8_w8a8")
    packed = pack_amx_w8a8(qw.weight)
    x = torch.randn(3, 128).bfloat16()
    with pytest.raises(RuntimeError, match="x has K=96, the weight 128"):  # same 64-blocks
        kernels.amx_w8a8_linear(torch.randn(3, 96).bfloat16(), packed, 128, qw.scale, None)
    with pytest.raises(RuntimeError, match="x has K=0"):
        kernels.amx_w8a8_linear(torch.randn(3, 0).bfloat16(), packed, 0, qw.scale, None)
    with pytest.raises(RuntimeError, match="scale has N=80"):
        kernels.amx_w8a8_linear(x, packed, 128, torch.ones(80), None)
    with pytest.raises(RuntimeError, match="pack_amx_w8a8"):
        kernels.amx_w8a8_linear(x, qw.weight, 128, qw.scale, None)
    with pytest.raises(RuntimeError, match="bias"):
        kernels.amx_w8a8_linear(x, packed, 128, qw.scale, torch.ones(3).bfloat16())


def test_pack_vnni_w8a8_puts_each_weight_where_the_gemm_reads_it():
    q = torch.randint(-128, 128, (70, 152), generator=torch.Generator().manual_seed(5))
    q = q.to(torch.int8)
    packed = pack_vnni_w8a8(q)
    assert packed.shape == (3, 38, 32, 4)  # 70 rows -> 3 panels of 32, 152 k -> 38 quads
    for n, k in [(0, 0), (17, 5), (33, 64), (69, 151), (40, 127)]:
        assert packed[n // 32, k // 4, n % 32, k % 4] == q[n, k]
    assert packed.flatten().abs().sum() == q.abs().sum()  # padding is zeros
    assert packed[2, :, 6:].abs().sum() == 0  # rows 70..95 do not exist
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_vnni_w8a8(q[:, :150])


@needs_vnni
@pytest.mark.parametrize("layout", ["vnni", "amx"])
@pytest.mark.parametrize(
    "rows, n, k",
    [(1, 32, 64), (5, 40, 96), (13, 100, 1040), (16, 200, 256), (70, 64, 512), (300, 48, 2048)],
)
def test_w8a8_gemms_on_packed_copies_match_the_reference(layout, rows, n, k):
    """Our int8_w8a8 GEMMs (w8a8_packed_linear on formats.prepack_w8a8's layouts): exact
    int32 sums (the VNNI GEMM's unsigned x + 128, less 128 x the weight's row sums; AMX's
    signed tiles), the per-token and per-channel scales and the bias applied as each tile
    leaves the registers. Partial tiles of rows, outputs and k, x in several chunks, and
    threads with several panels each (16 rows: the next panel prefetched as one is read).
    Both GEMMs scale in the reference's order: its numbers bit for bit."""
    if layout == "amx" and not _amx_available():
        pytest.skip("CPU (or Linux) lacks AMX-INT8")
    q = torch.randint(-128, 128, (n, k), generator=torch.Generator().manual_seed(n + k))
    qw = from_int8_values(q.to(torch.int8), torch.rand(n) / 100, "int8_w8a8")
    prepack_w8a8(qw, layout)
    gen = torch.Generator().manual_seed(rows)
    x = (3 * torch.randn(rows, k, generator=gen)).bfloat16()
    x[0] = 0.0  # a zero row: scale 1, all-zero output but the bias
    bias = torch.randn(n, generator=gen).bfloat16()
    for b in (None, bias):
        got = get_cpu_kernels().w8a8_packed_linear(x, qw.packed, k, qw.scale, qw.wsum, b)
        assert_matches_reference(got, x, qw, b)
        assert torch.equal(got, reference_linear(x, qw, b))


@needs_vnni
def test_vnni_w8a8_outputs_equal_the_reference_over_many_scales():
    """(acc * xs) * scale rounds differently from acc * (xs * scale) in the last float32
    bit, and at a bf16 midpoint that flips the output: ~1 in 10^5 outputs, so a single
    random scale (the test above) catches a reassociated epilogue only now and then. Over
    40 seeded scales, 576,000 outputs, the VNNI GEMM, the row kernel and (where the CPU
    has it) the AMX GEMM equal the reference everywhere."""
    kernels = get_cpu_kernels()
    q = torch.randint(-128, 128, (48, 2048), generator=torch.Generator().manual_seed(0))
    x = (3 * torch.randn(300, 2048, generator=torch.Generator().manual_seed(1))).bfloat16()
    for seed in range(40):
        scale = torch.rand(48, generator=torch.Generator().manual_seed(seed)) / 100
        qw = from_int8_values(q.to(torch.int8), scale, "int8_w8a8")
        prepack_w8a8(qw, "vnni")
        want = reference_linear(x, qw, None)
        got = kernels.w8a8_packed_linear(x, qw.packed, 2048, qw.scale, qw.wsum, None)
        assert torch.equal(got, want), f"seed {seed}: {(got != want).sum()} outputs differ"
        rows = kernels.quant_linear(x[:4], qw.kind, qw.weight, qw.scale, None, qw.wsum, 0, None)
        assert torch.equal(rows, want[:4]), f"seed {seed}: the row kernel differs"
        if _amx_available():
            tiles = pack_amx_w8a8(qw.weight)
            got = kernels.w8a8_packed_linear(x, tiles, 2048, qw.scale, qw.wsum, None)
            assert torch.equal(got, want), f"seed {seed}: the AMX GEMM differs"


@needs_vnni
def test_vnni_w8a8_gemm_rejects_mismatched_inputs():
    kernels = get_cpu_kernels()
    qw = quantize(_weights(40, 128, 1), "int8_w8a8")
    packed = pack_vnni_w8a8(qw.weight)
    x = torch.randn(3, 128).bfloat16()

    def call(**overrides):
        args = dict(x=x, packed=packed, k=128, scale=qw.scale, wsum=qw.wsum, bias=None)
        args.update(overrides)
        return kernels.vnni_w8a8_linear(*args.values())

    assert call().shape == (3, 40) and call(x=x[:0]).shape == (0, 40)
    for overrides, message in [
        (dict(x=torch.randn(3, 96).bfloat16()), "x has K=96, the weight 128"),
        (dict(x=x.float()), "x must be bf16"),
        (dict(scale=torch.ones(80), wsum=torch.zeros(80, dtype=torch.int32)), "scale has N=80"),
        (dict(wsum=qw.wsum[:4]), "wsum must be int32"),
        (dict(packed=qw.weight), "pack_vnni_w8a8"),
        (dict(packed=pack_amx_w8a8(qw.weight)), "pack_vnni_w8a8"),
        (dict(bias=torch.ones(3).bfloat16()), "bias"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            call(**overrides)
