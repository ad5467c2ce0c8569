"""Quantized weights: formats.py's quantize/dequantize/packing, and the compiled
`quant_linear` (kernels/quant_gemm.cpp, quant_w8a8.cpp) against `reference_linear`.

Tolerance of kernel against reference (`assert_matches_reference`). Both sum the same
float32 products (exact products: every decoded weight and every bf16 activation fits
a float's significand) in different orders, then round once to bf16. So

    |kernel - reference| <= ulp_bf16(y) + |e_kernel| + |e_reference|

with ulp_bf16(y) <= 2^-7 |y| (8 significant bits: the two may round a value near a
rounding boundary to neighbouring bf16s), and each float32 sum of K terms off by at most
K * 2^-24 * sum_k |term_k| (the textbook bound for recursive summation, plus the bias
add), hence the K * 2^-23 * S term, S = sum_k |x_k| |w_k| + |bias|. The terms are the
ones each side adds: |x| |dequantized w| for int8 and fp8; for int4 the kernel adds
(128 + n) * scale * x and subtracts the 128 + z offsets (quant_rows.h), so |w_k| is
bounded there by 143 * scale. int8_w8a8 sums exactly in integers on both sides; only
the float products and the bias add round, far inside the same bound.

The bound is loose; a second check keeps errors honest on average: the mean error must
stay below 2^-10 of the mean output, a small fraction of an ulp (outputs are equal but
for the rare values that lie near a rounding boundary).
"""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels import get_cpu_kernels
from minivllm.layers.linear_method import LinearMethodBase
from minivllm.quantization.formats import (
    FP8_MAX,
    KIND_INT4_W4A16,
    SCHEMES,
    QuantWeights,
    dequantize,
    from_fp8_values,
    from_int4_values,
    from_int8_values,
    pack_int4,
    quantize,
    quantize_per_token,
    reference_linear,
    unpack_int4,
)
from minivllm.quantization.kernel_limits import (
    kernel_supports,
    kernel_supports_shape,
    max_dequantized_rows,
    max_kernel_rows,
)
from minivllm.quantization.packing import pack_vnni_w8a8, prepack_w4a8, prepack_w8a8

needs_bf16 = pytest.mark.skipif(not kernel_supports("int8_w8a16"), reason="CPU lacks AVX512-BF16")
needs_vnni = pytest.mark.skipif(
    not kernel_supports("int8_w8a8"), reason="CPU lacks AVX512-VNNI (or AVX512-BF16)"
)

# (scheme, symmetric, group_size): the weight formats under test
FORMATS = [
    ("int8_w8a16", True, 0),
    ("int8_w8a8", True, 0),
    ("fp8_w8a16", True, 0),
    ("int4_w4a16", True, 32),
    ("int4_w4a16", True, 128),
    ("int4_w4a16", False, 32),
    ("int4_w4a16", False, 128),
]
# (N, K): most N leave a partial block of rows (blocks of 8 at M = 1, 2-8 up to M = 4, 6
# or 3 past); K of 96, 160, 288 leave a partial last unit (64 k, or 128 k for int4)
SHAPES = [(37, 256), (64, 1024), (100, 96), (13, 160), (50, 288)]
ROWS = [1, 2, 3, 4, 16, 64, 100]  # 1-4 decode in registers, more through the scratch


def _weights(n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen)


def _quantize(scheme: str, symmetric: bool, group: int, w: torch.Tensor) -> QuantWeights:
    return quantize(w, scheme, group_size=group or 128, symmetric=symmetric)


# -- formats ----------------------------------------------------------------------------


@pytest.mark.parametrize("scheme,symmetric,group", FORMATS)
def test_dequantize_is_within_the_rounding_bound(scheme, symmetric, group):
    # wide dynamic range per row, so fp8 meets its subnormals and int4 lopsided groups
    w = _weights(24, 256, 0) * torch.logspace(-4, 1, 256)[torch.randperm(256)]
    w[3] = 0.0  # a zero row: scale 1
    w[5, :128] = 0.7  # constant groups (for int4, one-signed ranges widened to 0)
    qw = _quantize(scheme, symmetric, group, w)
    err = (w - dequantize(qw)).abs()
    if scheme == "fp8_w8a16":
        # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normals (|w/s| >= 2^-6),
        # absolute <= 2^-10 (half the subnormal spacing 2^-9) below; + float32 rounding
        scale = qw.scale[:, None]
        assert (err <= (2**-4 + 2**-20) * w.abs() + 2**-10 * scale).all()
    else:
        # round to nearest: |w/s - q| <= 1/2, so |w - deq| <= s/2; the float32 rounding
        # of w/s and of q*s adds at most 2 * 127 * 2^-24 s. For asymmetric int4, z is the
        # rounded -lo/s, and the range [lo, hi] spans 15 steps: the clamp to [0, 15]
        # only moves a value that rounding pushed just past an end, by the same half step.
        scale = qw.scale[:, None] if group == 0 else qw.scale.repeat_interleave(group, 1)
        assert (err <= (0.5 + 2**-16) * scale).all()
    assert torch.equal(dequantize(qw)[3], torch.zeros(256))


def test_pack_int4_layout_and_round_trip():
    q = torch.randint(0, 16, (3, 96), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (3, 48)
    for chunk in range(3):  # byte j of each 32-element chunk: q[j] | q[j + 16] << 4
        for j in range(16):
            k = 32 * chunk + j
            assert int(packed[1, 16 * chunk + j]) == int(q[1, k]) | int(q[1, k + 16]) << 4
    assert torch.equal(unpack_int4(packed), q)
    with pytest.raises(ValueError):
        pack_int4(q[:, :48])


def test_quant_weights_round_trip_and_validation():
    qw = quantize(_weights(8, 64, 1), "int4_w4a16", group_size=32, symmetric=False)
    assert set(qw.tensors()) == {"weight", "scale", "zero"}
    again = QuantWeights.from_tensors(qw.tensors(), qw.scheme, qw.group_size, 8, 64)
    assert torch.equal(dequantize(again), dequantize(qw))
    # pre-quantized values are taken as they are
    same = from_int4_values(unpack_int4(qw.weight), qw.scale, qw.zero, 32)
    assert torch.equal(same.weight, qw.weight)
    with pytest.raises(ValueError, match="scale"):
        QuantWeights("int4_w4a16", qw.weight, qw.scale[:, :1], None, None, 32, 8, 64)
    with pytest.raises(ValueError, match="group"):
        quantize(_weights(8, 96, 1), "int4_w4a16", group_size=64)
    with pytest.raises(ValueError, match="NaN"):
        from_fp8_values(torch.full((2, 32), 0x7F, dtype=torch.uint8), torch.ones(2))
    assert kernel_supports_shape("int4_w4a16", 256, 128)
    assert not kernel_supports_shape("int4_w4a16", 256, 48)
    assert not kernel_supports_shape("int8_w8a16", 100)


# -- kernels ----------------------------------------------------------------------------


def assert_matches_reference(got, x, qw, bias):
    """The bound derived in the module docstring."""
    ref = reference_linear(x, qw, bias).double()
    got = got.double()
    if qw.scheme == "int4_w4a16":
        magnitude = 143 * qw.scale.double().repeat_interleave(qw.group_size, 1)
    else:
        magnitude = dequantize(qw).double().abs()
    terms = x.double().abs() @ magnitude.T
    if bias is not None:
        terms += bias.double().abs()
    err = (got - ref).abs()
    assert (err <= 2**-7 * ref.abs() + qw.in_features * 2**-23 * terms).all(), err.max()
    assert err.mean() <= 2**-10 * ref.abs().mean()


def _block_fp8(w: torch.Tensor, group: int) -> QuantWeights:
    """fp8 with a scale per row and group of k, as block-scaled checkpoints load."""
    scale = w.unflatten(-1, (-1, group)).abs().amax(-1) / FP8_MAX
    q = (w / scale.repeat_interleave(group, -1)).to(torch.float8_e4m3fn)
    return from_fp8_values(q, scale, group)


def _check_format(scheme, symmetric, group, n, k):
    _check_weights(_quantize(scheme, symmetric, group, _weights(n, k, n * k + group)), n, k)


def _check_weights(qw: QuantWeights, n: int, k: int) -> None:
    kernels = get_cpu_kernels()
    gen = torch.Generator().manual_seed(k)
    bias = torch.randn(n, generator=gen).bfloat16()
    for rows in ROWS:
        x = (2 * torch.randn(rows, k, generator=gen)).bfloat16()
        for b in (None, bias):
            got = kernels.quant_linear(
                x, qw.kind, qw.weight, qw.scale, qw.zero, qw.wsum, qw.group_size, b
            )
            assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
            assert_matches_reference(got, x, qw, b)


@needs_bf16
@pytest.mark.parametrize(
    "scheme,symmetric,group,n,k",
    [
        (*fmt, n, k)
        for fmt in FORMATS
        for n, k in SHAPES
        if fmt[0] != "int8_w8a8" and kernel_supports_shape(fmt[0], k, fmt[2])
    ],
)
def test_weight_only_kernels_match_the_reference(scheme, symmetric, group, n, k):
    _check_format(scheme, symmetric, group, n, k)


@needs_bf16
@pytest.mark.parametrize("group,k", [(64, 192), (96, 288), (160, 320)])
def test_int4_groups_that_straddle_units(group, k):
    # the kernel runs 128 k at a time: these groups start and end inside a unit
    _check_format("int4_w4a16", False, group, 21, k)


@needs_bf16
@pytest.mark.parametrize(
    "group,n,k", [(64, 37, 256), (128, 13, 384), (192, 50, 384), (128, 64, 1024)]
)
def test_block_scaled_fp8_kernel_matches_the_reference(group, n, k):
    """fp8 with a scale per row and group of k (DeepSeek's and Qwen's fp8 releases), on the
    bf16 kernel: each group's partial sums scaled, in registers and through the scratch."""
    qw = _block_fp8(
        _weights(n, k, n + k) * torch.rand(n, k // group).repeat_interleave(group, 1), group
    )
    _check_weights(qw, n, k)
    out = torch.empty(n, k, dtype=torch.bfloat16)
    get_cpu_kernels().dequantize_bf16(qw.kind, qw.weight, qw.scale, None, group, out)
    assert torch.equal(out, dequantize(qw).to(torch.bfloat16))


@needs_bf16
def test_block_fp8_groups_the_kernel_does_not_take():
    """Groups of 32 k (half the kernel's unit) are refused by the op and left to the AVX2
    family's op by the method (kernel_supports_shape says no)."""
    qw = _block_fp8(_weights(8, 128, 3), 32)
    assert not kernel_supports_shape("fp8_w8a16", 128, 32)
    assert kernel_supports_shape("fp8_w8a16", 128, 64) and not kernel_supports_shape(
        "fp8_w8a16", 96, 64
    )
    with pytest.raises(RuntimeError, match="multiple of 64"):
        get_cpu_kernels().quant_linear(
            torch.ones(1, 128).bfloat16(), qw.kind, qw.weight, qw.scale, None, None, 32, None
        )
    with pytest.raises(RuntimeError, match="scale must have shape"):
        get_cpu_kernels().quant_linear(
            torch.ones(1, 128).bfloat16(), qw.kind, qw.weight, qw.scale, None, None, 64, None
        )


@needs_vnni
@pytest.mark.parametrize("n,k", SHAPES)
def test_w8a8_kernel_matches_the_reference(n, k):
    _check_format("int8_w8a8", True, 0, n, k)


@needs_vnni
def test_w8a8_kernel_takes_minus_128_weights():
    """compressed-tensors' checkpoints reach q = -128 (their scale is max|w| / 127.5)."""
    kernels = get_cpu_kernels()
    q = torch.randint(
        -128, 128, (40, 96), generator=torch.Generator().manual_seed(3), dtype=torch.int8
    )
    q[:, 0] = -128
    qw = from_int8_values(q, torch.rand(40) / 100, "int8_w8a8")
    for rows in (1, 5):
        x = torch.randn(rows, 96).bfloat16()
        got = kernels.quant_linear(x, qw.kind, qw.weight, qw.scale, None, qw.wsum, 0, None)
        assert_matches_reference(got, x, qw, None)
    x = torch.randn(40, 96).bfloat16()  # and the VNNI GEMM, at large batches
    got = kernels.vnni_w8a8_linear(x, pack_vnni_w8a8(qw.weight), 96, qw.scale, qw.wsum, None)
    assert torch.equal(got, reference_linear(x, qw, None))


@needs_bf16
def test_fp8_zeros_and_subnormals_decode_exactly():
    # every e4m3 byte but the NaNs, in each row: the exponent-0 ones (zeros, subnormals)
    # take the kernel's patch path
    numbers = torch.tensor(
        [b for b in range(256) if b & 0x7F != 0x7F] + [0, 0x80], dtype=torch.uint8
    )
    q = torch.stack([numbers[torch.randperm(256)] for _ in range(8)])
    qw = from_fp8_values(q, torch.rand(8) + 0.5)
    x = torch.randn(3, 256).bfloat16()
    got = get_cpu_kernels().quant_linear(x, qw.kind, qw.weight, qw.scale, None, None, 0, None)
    assert_matches_reference(got, x, qw, None)


@needs_bf16
def test_quantize_per_token_int8_equals_the_reference_bit_for_bit():
    x = torch.randn(6, 256).bfloat16()
    x[1] = 0.0  # scale 1
    x[2, 0], x[2, 1:5] = 127.0, torch.tensor([2.5, 3.5, -2.5, 0.5])  # xs = 1: ties to even
    q, xs = get_cpu_kernels().quantize_per_token_int8(x)
    want_q, want_xs = quantize_per_token(x)
    assert torch.equal(q, want_q) and torch.equal(xs, want_xs)
    assert q[2, 1:5].tolist() == [2, 4, -2, 0]


def _amx_available() -> bool:
    kernels = get_cpu_kernels() if kernel_supports("int8_w8a8") else None
    return kernels is not None and kernels.amx_w8a8_available()


@needs_bf16
@pytest.mark.parametrize("scheme, symmetric, group", FORMATS)
def test_dequantize_bf16_equals_the_reference_rounded_once(scheme, symmetric, group):
    """The large-batch path's dequantization: formats.dequantize(qw).to(bf16), bit for bit."""
    qw = _quantize(scheme, symmetric, group, _weights(48, 256, 7) * 3)
    out = torch.empty(48, 256, dtype=torch.bfloat16)
    get_cpu_kernels().dequantize_bf16(qw.kind, qw.weight, qw.scale, qw.zero, qw.group_size, out)
    assert torch.equal(out, dequantize(qw).to(torch.bfloat16))


@needs_bf16
def test_dequantize_bf16_decodes_every_fp8_byte():
    numbers = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    q = torch.cat([numbers, numbers[: 256 - len(numbers)]]).reshape(-1, 32)
    assert q.shape == (8, 32)  # every non-NaN byte, zeros and subnormals included
    qw = from_fp8_values(q, torch.rand(8) + 0.5)
    out = torch.empty(8, 32, dtype=torch.bfloat16)
    get_cpu_kernels().dequantize_bf16(qw.kind, qw.weight, qw.scale, None, 0, out)
    assert torch.equal(out, dequantize(qw).to(torch.bfloat16))


@needs_bf16
def test_quant_linear_rejects_malformed_inputs():
    kernels = get_cpu_kernels()
    qw = quantize(_weights(16, 128, 2), "int4_w4a16", group_size=64)
    x = torch.randn(2, 128).bfloat16()

    def call(**overrides):
        args = dict(
            x=x,
            kind=KIND_INT4_W4A16,
            weight=qw.weight,
            scale=qw.scale,
            zero=None,
            wsum=None,
            group_size=64,
            bias=None,
        )
        args.update(overrides)
        return kernels.quant_linear(*args.values())

    call()
    for overrides, message in [
        (dict(x=x.float()), "x must be bf16"),
        (dict(kind=7), "kind must be"),
        (dict(weight=qw.weight.view(torch.int8)), "weight must be"),
        (dict(weight=qw.weight.t().contiguous().t()), "contiguous"),
        (dict(scale=qw.scale[:, :1]), "scale must have shape"),
        (dict(group_size=48), "group_size"),
        (dict(x=torch.randn(2, 64).bfloat16()), "weight must have shape"),
        (dict(bias=torch.zeros(15, dtype=torch.bfloat16)), "bias"),
        (
            dict(
                kind=1,
                weight=torch.zeros(16, 128, dtype=torch.int8),
                scale=torch.ones(16),
                zero=torch.ones(16, 2),
            ),
            "zero points",
        ),
    ]:
        with pytest.raises(RuntimeError, match=message):
            call(**overrides)


def test_schemes_and_kinds_agree():
    assert set(SCHEMES) == {"int8_w8a16", "int8_w8a8", "int4_w4a16", "int4_w4a8", "fp8_w8a16"}
    kinds = [quantize(_weights(2, 64, 3), s, group_size=32).kind for s in SCHEMES]
    assert kinds == [1, 4, 2, 5, 3]


# -- the fused decode step with quantized linears -------------------------------------------


class _KernelQuantMethod(LinearMethodBase):
    """A stand-in for a quantized linear method: a bf16 layer's weight, quantized, applied
    with the kernels (past max_kernel_rows a GEMM on int8_w8a8's packed copy,
    dequantized_linear up to max_dequantized_rows, then a GEMM on the dequantized
    weight)."""

    def __init__(self, weights: QuantWeights) -> None:
        self.quant_weights = weights
        self.kernels_on = True

    def create_weights(self, layer, input_size, output_size, weight_loader) -> None:
        raise NotImplementedError("built from a loaded layer")

    def apply(self, layer, x, bias):
        kernels, qw = get_cpu_kernels(), self.quant_weights
        rows = x.reshape(-1, qw.in_features)
        if qw.scheme == "int4_w4a8":  # every batch on its panels
            y = kernels.int4_w4a8_packed_linear(
                rows, qw.packed, qw.out_features, qw.group_size, bias
            )
        elif rows.shape[0] > max_kernel_rows(qw) and qw.scheme == "int8_w8a8":
            y = kernels.w8a8_packed_linear(rows, qw.packed, qw.in_features, qw.scale, qw.wsum, bias)
        elif max_kernel_rows(qw) < rows.shape[0] <= max_dequantized_rows(qw):
            args = (qw.kind, qw.weight, qw.scale, qw.zero, qw.group_size, bias)
            y = kernels.dequantized_linear(rows, *args)
        elif rows.shape[0] > max_kernel_rows(qw):  # dequantized for oneDNN's GEMM
            dense = torch.empty(qw.out_features, qw.in_features, dtype=torch.bfloat16)
            kernels.dequantize_bf16(qw.kind, qw.weight, qw.scale, qw.zero, qw.group_size, dense)
            y = torch.nn.functional.linear(rows, dense, bias)
        else:
            args = (qw.kind, qw.weight, qw.scale, qw.zero, qw.wsum, qw.group_size, bias)
            y = kernels.quant_linear(rows, *args)
        return y.view(*x.shape[:-1], qw.out_features)


@needs_vnni
@pytest.mark.parametrize("packing", ["amx", "vnni"])
def test_fused_decode_with_quantized_linears_equals_the_per_layer_path(make_checkpoint, packing):
    """Every quant kind in one model (a kind per linear, int4_w4a8's panels too): the
    one-call decode step and the per-layer path run the same kernels, so their outputs are
    equal bit for bit."""
    if packing == "amx" and not _amx_available():
        pytest.skip("CPU (or Linux) lacks AMX-INT8")
    llm = _decode_engine(make_checkpoint)
    runner = llm.llm_engine.executor.runner
    formats = [f for f in FORMATS if f[0] != "int4_w4a16" or f[2] == 32]
    formats += [("int4_w4a16", 0, 64), ("int4_w4a8", 0, 32)]
    linears = [lin for layer in runner.model.decoder_stack_parts().layers for lin in layer.linears]
    for i, linear in enumerate(linears):
        scheme, symmetric, group = formats[i % len(formats)]
        qw = _quantize(scheme, bool(symmetric), group, linear.weight.float())
        if scheme == "int8_w8a8":  # batches past w8a8_max_kernel_rows run the packed copy
            prepack_w8a8(qw, packing)
        if scheme == "int4_w4a8":  # every batch on its panels (kind 5 in the step)
            prepack_w4a8(qw)
        linear.quant_method = _KernelQuantMethod(qw)
    _assert_fused_equals_per_layer(llm)


@needs_bf16
def test_fused_decode_with_block_fp8_linears_equals_the_per_layer_path(make_checkpoint):
    """Block-scaled fp8 (a scale per row and 64 k) beside per-channel fp8 in the one-call
    decode step: the step reads the group from the scale's shape and keeps each form's
    row limits (20 rows: past block fp8's 16, so dequantized_linear, within per-channel
    fp8's 64)."""
    llm = _decode_engine(make_checkpoint)
    runner = llm.llm_engine.executor.runner
    linears = [lin for layer in runner.model.decoder_stack_parts().layers for lin in layer.linears]
    for i, linear in enumerate(linears):
        w = linear.weight.float()
        qw = _block_fp8(w, 64) if i % 2 == 0 else quantize(w, "fp8_w8a16")
        linear.quant_method = _KernelQuantMethod(qw)
    _assert_fused_equals_per_layer(llm)


def _decode_engine(make_checkpoint):
    """A tiny bf16 Qwen3 engine whose linears the fused-step tests replace."""
    from minivllm import LLM

    return LLM(
        str(make_checkpoint("Qwen3ForCausalLM")),
        dtype="bfloat16",
        kv_cache_memory_bytes=4 << 20,
        max_model_len=64,
        block_size=4,
        enable_prefix_caching=False,
    )


def _assert_fused_equals_per_layer(llm) -> None:
    from minivllm import SamplingParams
    from minivllm.layers.fused_decode import FusedLlamaDecode

    runner = llm.llm_engine.executor.runner
    fused_step, reason = FusedLlamaDecode.build(runner.model, runner.kernels, runner.attn_backend)
    assert reason == "on"
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    # 20 rows: past int4's and int8_w8a8's kernel rows (int4 on dequantized_linear); 3 within
    for num_prompts in (20, 3):
        prompts = [{"prompt_token_ids": list(range(5, 6 + n))} for n in range(num_prompts)]
        results = []
        for fused in (fused_step, None):
            runner.fused_decode = fused
            outs = llm.generate(prompts, params, use_tqdm=False)
            results.append(
                [
                    (
                        o.outputs[0].token_ids,
                        [{t: p.logprob for t, p in d.items()} for d in o.outputs[0].logprobs],
                    )
                    for o in outs
                ]
            )
        runner.fused_decode = fused_step
        assert results[0] == results[1]
