"""The AVX-512 form of int8 and int4 rows in fp32 engines (`kernels/avx512_quantw.cpp`),
on AVX-512 CPUs with VNNI, against two oracles: the float64 product of the dequantized
weights (within test_avx2_quant.py's derived bound for the integer form) and the AVX2
integer form on the same operands.

The two forms round x to int16 in the same blocks with the same scales and sum each
block's products exactly in int32; they differ only in how the blocks' fp32 terms are
added (16 lanes against 8). Per output that is a sum of (blocks x lanes) fp32 terms,
each of which the other form also rounds: the two results differ by at most
2 (terms + 2) 2^-24 of the sum of |terms|, which is below 2 (terms + 2) 2^-24 sum_k
|x_k v_k| plus x's rounding, the bound `_agree` checks (loose by design, far tighter than
any real mistake: a lost block or a misplaced k moves a result by a whole term).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from minivllm.kernels.isa import AVX512_VNNI_FLAGS, cpu_flags
from minivllm.quantization import formats
from tests.conftest import needs_avx2
from tests.test_avx2_quant import _bound

needs_vnni = pytest.mark.skipif(
    not AVX512_VNNI_FLAGS <= cpu_flags(), reason="CPU lacks AVX-512 F/BW/VL or VNNI"
)
pytestmark = [needs_avx2, needs_vnni]


def _run(avx2, qw, x, avx512: bool) -> torch.Tensor:
    before = avx2.set_quantw_avx512(avx512)
    try:
        return avx2.linear_quantw(x, qw.kind, qw.weight, qw.scale, qw.zero, qw.group_size, None)
    finally:
        avx2.set_quantw_avx512(before)


def _agree(x: torch.Tensor, qw: formats.QuantWeights, a: torch.Tensor, b: torch.Tensor) -> bool:
    """The module docstring's bound between the two forms."""
    block = qw.group_size if qw.scheme in formats.INT4_SCHEMES else 128
    terms = 16 * (qw.in_features // block + 2)
    w = formats.dequantize(qw).double()
    if qw.scheme in formats.INT4_SCHEMES:  # the forms sum q and subtract the zero's term
        q = formats.unpack_int4(qw.weight).double()
        scale = qw.scale.double().repeat_interleave(qw.group_size, 1)
        w = (q.abs() + 15) * scale
    sums = x.double().abs() @ w.abs().T
    amax = x.double().abs().amax(dim=1, keepdim=True)
    bound = 2 * (terms + 2) * 2.0**-24 * (sums + (amax / 32767) * w.abs().sum(1))
    return bool(((a.double() - b.double()).abs() <= bound).all())


CASES = [
    ("int8_w8a16", 0, True, 1024),
    ("int8_w8a16", 0, True, 1000),  # a K % 32 tail in fp32
    ("int8_w8a16", 0, True, 3072),
    ("int4_w4a16", 128, True, 1024),
    ("int4_w4a16", 128, False, 1024),
    ("int4_w4a16", 256, False, 2048),
    ("int4_w4a16", 2048, True, 2048),  # the largest group the form takes
]


@pytest.mark.parametrize("scheme,group,symmetric,k", CASES)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("n", [37, 256])
def test_avx512_form_matches_float64_and_the_avx2_form(avx2, scheme, group, symmetric, k, m, n):
    """Both oracles, every tile shape (1 x 4, 2 x 2, 4 x 2 and the edges of 37 rows)."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    qw = formats.quantize(torch.randn(n, k, generator=gen), scheme, group or 128, symmetric)
    x = torch.randn(m, k, generator=gen) * 3
    fast = _run(avx2, qw, x, True)
    plain = _run(avx2, qw, x, False)
    ref = x.double() @ formats.dequantize(qw).double().T
    assert ((fast.double() - ref).abs() <= _bound(x, qw, ref, torch.zeros(n))).all()
    assert _agree(x, qw, fast, plain)
    assert not torch.equal(fast, torch.zeros_like(fast))


@pytest.mark.parametrize("k", [1024, 1000])
@pytest.mark.parametrize("m", [9, 16, 40, 64])
def test_avx512_int8_batches_match_float64(avx2, k, m):
    """int8 up to 64 rows in the AVX-512 form (4 x 2 tiles and their edges), against the
    float64 product (the AVX2 family multiplies these batches on fp32 panels instead,
    with other roundings, so it is no second oracle here)."""
    gen = torch.Generator().manual_seed(m + k)
    qw = formats.quantize(torch.randn(70, k, generator=gen), "int8_w8a16")
    x = torch.randn(m, k, generator=gen)
    y = _run(avx2, qw, x, True)
    ref = x.double() @ formats.dequantize(qw).double().T
    assert ((y.double() - ref).abs() <= _bound(x, qw, ref, torch.zeros(70))).all()


@pytest.mark.parametrize("weight,symmetric", [(1.0, True), (1.0, False), (-1.0, False)])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_avx512_int4_sums_hold_the_largest_group(avx2, weight, symmetric, sign):
    """int4's int32 sums at their largest (test_avx2_quant's construction: a group of
    2048, every q at 15 or 0, every x at +-32766 quanta) in the AVX-512 form."""
    qw = formats.quantize(torch.full((4, 2048), weight), "int4_w4a16", 2048, symmetric)
    x = torch.full((3, 2048), sign * 15.999)
    y = _run(avx2, qw, x, True)
    ref = x.double() @ formats.dequantize(qw).double().T
    assert ((y.double() - ref).abs() <= _bound(x, qw, ref, torch.zeros(4))).all()


@pytest.mark.parametrize("group", [32, 64])
def test_groups_the_form_does_not_take_run_the_avx2_form(avx2, group):
    """int4 groups below 128 keep the AVX2 form: the same result either way."""
    gen = torch.Generator().manual_seed(group)
    qw = formats.quantize(torch.randn(24, 256, generator=gen), "int4_w4a16", group, False)
    x = torch.randn(2, 256, generator=gen)
    assert torch.equal(_run(avx2, qw, x, True), _run(avx2, qw, x, False))


@pytest.mark.parametrize("scheme,group", [("int8_w8a16", 0), ("int4_w4a16", 128)])
def test_avx512_form_propagates_nan(avx2, scheme, group):
    """A NaN in a row of x reaches every output of that row, not the other rows."""
    gen = torch.Generator().manual_seed(3)
    qw = formats.quantize(torch.randn(20, 256, generator=gen), scheme, group or 128)
    x = torch.randn(3, 256, generator=gen)
    x[1, 200] = float("nan")
    y = _run(avx2, qw, x, True)
    assert not bool(torch.isfinite(y[1]).any())
    assert bool(torch.isfinite(y[0]).all()) and bool(torch.isfinite(y[2]).all())


def test_the_switch_follows_the_isa_cap(avx2):
    """The family loads with the form on where cpu_flags() has the extensions, and off
    under MINIVLLM_CPU_ISA=avx2 (a fresh process: the flags are read once)."""
    assert avx2.set_quantw_avx512(True) is True  # on at load here, so the previous state
    code = (
        "from minivllm.kernels import get_avx2_kernels\n"
        "m = get_avx2_kernels()\n"
        "print(m.set_quantw_avx512(False))\n"
    )
    env = {**os.environ, "MINIVLLM_CPU_ISA": "avx2"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"
