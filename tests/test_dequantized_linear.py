"""`dequantized_linear` (kernels/quant_gemm.cpp): x @ dequantize_bf16(W)^T + b without the
dequantized copy, the path of int4 and block-scaled fp8 batches of a few dozen rows.

Oracle: the same product in float64 on `formats.dequantize(qw)` rounded to bf16 (what
`dequantize_bf16` writes, bit for bit, test_quant_kernels.py). Every product of a bf16
weight and a bf16 activation is exact in float32, so the kernel differs from the oracle
only by its float32 sums, at most K * 2^-24 * S with S = sum_k |x_k| |w_k| + |bias|
(recursive summation's bound), and its final rounding to bf16, at most half an ulp,
2^-8 |y|. A second check keeps errors honest on average: rounding to nearest moves a value
by a quarter of an ulp on average, at most 2^-9 |y|, so the mean error must stay below
twice that, 2^-8 of the mean output (a kernel off by a bf16 step of its weights or sums
lands above it).
"""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels import get_cpu_kernels
from minivllm.quantization import formats, kernel_limits
from minivllm.quantization.formats import dequantize, quantize
from minivllm.quantization.kernel_limits import kernel_supports
from tests.test_quant_kernels import _block_fp8

needs_bf16 = pytest.mark.skipif(not kernel_supports("int8_w8a16"), reason="CPU lacks AVX512-BF16")

# (scheme, symmetric, group, N, K): int4's table decodes 64 k at a time, so K = 160 and
# 288 end on a lone 32-k chunk, groups of 32 and 96 change group inside a 64-k step, and
# N = 37 and 13 leave a partial block of the kernel's 6 rows
CASES = [
    ("int4_w4a16", True, 128, 37, 256),
    ("int4_w4a16", False, 128, 64, 1024),
    ("int4_w4a16", True, 32, 13, 160),
    ("int4_w4a16", False, 32, 50, 288),
    ("int4_w4a16", False, 96, 21, 288),
    ("fp8_blocks", True, 128, 37, 256),
    ("fp8_blocks", True, 64, 13, 192),
    ("fp8_w8a16", True, 0, 37, 256),
    ("int8_w8a16", True, 0, 13, 160),
]


def _weights(scheme: str, symmetric: bool, group: int, n: int, k: int) -> formats.QuantWeights:
    gen = torch.Generator().manual_seed(n * k + group)
    w = torch.randn(n, k, generator=gen)
    if scheme == "fp8_blocks":
        return _block_fp8(
            w * torch.rand(n, k // group, generator=gen).repeat_interleave(group, 1), group
        )
    return quantize(w, scheme, group_size=group or 128, symmetric=symmetric)


def _assert_within_bound(got: torch.Tensor, x: torch.Tensor, qw, bias) -> None:
    w = dequantize(qw).to(torch.bfloat16).double()
    ref = x.double() @ w.T
    terms = x.double().abs() @ w.abs().T
    if bias is not None:
        ref += bias.double()
        terms += bias.double().abs()
    err = (got.double() - ref).abs()
    assert (err <= 2**-8 * ref.abs() + qw.in_features * 2**-24 * terms).all(), err.max()
    assert err.mean() <= 2**-8 * ref.abs().mean()


@needs_bf16
@pytest.mark.parametrize("scheme,symmetric,group,n,k", CASES)
def test_dequantized_linear_matches_the_rounded_weights_product(scheme, symmetric, group, n, k):
    kernels = get_cpu_kernels()
    qw = _weights(scheme, symmetric, group, n, k)
    gen = torch.Generator().manual_seed(k)
    bias = torch.randn(n, generator=gen).bfloat16()
    for rows in (1, 5, 6, 7, 16, 40):  # tiles of 1-4 rows of x
        x = (2 * torch.randn(rows, k, generator=gen)).bfloat16()
        for b in (None, bias):
            got = kernels.dequantized_linear(
                x, qw.kind, qw.weight, qw.scale, qw.zero, qw.group_size, b
            )
            assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
            _assert_within_bound(got, x, qw, b)


@needs_bf16
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group,k", [(32, 160), (64, 192), (96, 288), (128, 384)])
def test_int4_table_dequantization_is_the_reference_rounded_once(symmetric, group, k):
    """dequantize_row's int4 table (64 k a step, a lone 32-k chunk at K = 160 and 288,
    groups that change inside a step at 32 and 96): formats.dequantize(qw).to(bf16),
    bit for bit, as dequantize_bf16 writes it."""
    qw = _weights("int4_w4a16", symmetric, group, 19, k)
    out = torch.empty(19, k, dtype=torch.bfloat16)
    get_cpu_kernels().dequantize_bf16(qw.kind, qw.weight, qw.scale, qw.zero, group, out)
    assert torch.equal(out, dequantize(qw).to(torch.bfloat16))


@needs_bf16
def test_dequantized_linear_rejects_malformed_inputs():
    kernels = get_cpu_kernels()
    qw = quantize(torch.randn(16, 128), "int4_w4a16", group_size=64)
    x = torch.randn(2, 128).bfloat16()

    def call(**overrides):
        args = dict(x=x, kind=2, weight=qw.weight, scale=qw.scale, zero=None, group=64, bias=None)
        args.update(overrides)
        return kernels.dequantized_linear(*args.values())

    call()
    for overrides, message in [
        (dict(x=x.float()), "x must be bf16"),
        (dict(kind=7), "kind must be 1-4"),
        (dict(x=torch.randn(2, 64).bfloat16()), "weight must have shape"),
        (dict(scale=qw.scale[:, :1]), "scale must have shape"),
        (dict(group=48), "group_size must be a positive multiple of 32"),
        (dict(group=0), "group_size must be a positive multiple of 32"),
        (dict(bias=torch.zeros(15, dtype=torch.bfloat16)), "bias must have shape"),
        (
            dict(
                kind=1,
                weight=torch.zeros(16, 128, dtype=torch.int8),
                scale=torch.ones(16),
                zero=torch.ones(16, 2),
            ),
            r"only int4 \(kind 2\) takes zero points",
        ),
    ]:
        with pytest.raises(RuntimeError, match=f"dequantized_linear: {message}"):
            call(**overrides)


@needs_bf16
def test_int4_batches_between_the_kernels_rows_and_the_gemm_run_it(make_checkpoint):
    """In an int4 engine, batches past quant_linear's rows and up to
    kernel_limits.max_dequantized_rows run dequantized_linear (its output bit for bit), past
    them dequantize + oneDNN's GEMM (its output bit for bit); both within the bound of
    the rounded weights' product."""
    from tests.test_quantization import SMALL_GROUPS, _engine

    llm = _engine(
        make_checkpoint("Qwen3ForCausalLM"),
        dtype="bfloat16",
        quantization="int4",
        quantization_config=SMALL_GROUPS,
    )
    layer = llm.llm_engine.executor.runner.model.get_submodule("model.layers.0.mlp.down_proj")
    method, qw = layer.quant_method, layer.quant_method.quant_weights
    assert method.kernel_rows < method.dequantized_rows == kernel_limits.max_dequantized_rows(qw)
    kernels, gen = get_cpu_kernels(), torch.Generator().manual_seed(0)
    for rows in (method.kernel_rows + 1, method.dequantized_rows, method.dequantized_rows + 1):
        x = torch.randn(rows, qw.in_features, generator=gen).bfloat16()
        got = method.apply(layer, x, None)
        _assert_within_bound(got, x, qw, None)
        if rows <= method.dequantized_rows:
            want = kernels.dequantized_linear(
                x, qw.kind, qw.weight, qw.scale, qw.zero, qw.group_size, None
            )
        else:
            dense = torch.empty(qw.out_features, qw.in_features, dtype=torch.bfloat16)
            kernels.dequantize_bf16(qw.kind, qw.weight, qw.scale, qw.zero, qw.group_size, dense)
            want = torch.nn.functional.linear(x, dense)
        assert torch.equal(got, want), rows
