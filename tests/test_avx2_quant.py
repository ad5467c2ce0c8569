"""Quantized weights in fp32 engines on AVX2 (`kernels/avx2_quant.cpp`): int8, int4 and
fp8 rows decoded in registers, and int8_w8a8 on its per-token quantized activations.

Tolerance of `linear_quantw`: every decoded weight value is exact, and inside an FMA each
product x_k * v_k is exact too, so the fp32 result differs from the float64 reference
only by its sums' roundings: recursive summation of K terms is off by at most
K 2^-24 sum_k |x_k v_k|. int4 sums q (not q - z) and subtracts z * sum(x) per group, a
second sum of the same length, and scales each group's sum (one rounding); the
panel form (past 8 rows) rounds (q - z) * s once and sums in the panel GEMM. The test bound
covers all of these: (2 K + 8) 2^-24 sum_k |x_k| (|q_k| + |z|) s, plus 2^-23 of the
result and the bias.

Up to 8 rows int8 and int4 take the integer form (int8 up to 64 on AVX-512 CPUs with VNNI,
`kernels/avx512_quantw.cpp`): x is rounded to int16 in blocks with a
power-of-two scale s_b < 2 amax_b / 32767 (at least 2^-126), so each x_k moves by at most
s_b / 2 < max(amax / 32767, 2^-127) (amax: the row's largest |x|), and the result by at
most that times sum_k |v_k| more; its integer sums are exact, and their conversions and
scaling are a few roundings the bound above already covers.
"""

from __future__ import annotations

import re

import pytest
import torch

from minivllm.quantization import formats
from tests.conftest import needs_avx2


def _integer_form(scheme: str, m: int) -> bool:
    """Whether linear_quantw multiplies m rows of x rounded to int16: int8 and int4 up to 8
    rows; on AVX-512 CPUs with VNNI (avx512_quantw.cpp, on at load) int8 up to 64."""
    from minivllm.kernels.isa import AVX512_VNNI_FLAGS, cpu_flags

    if scheme == "int8_w8a16" and AVX512_VNNI_FLAGS <= cpu_flags():
        return m <= 64
    return scheme in ("int8_w8a16", "int4_w4a16") and m <= 8


def _bound(x: torch.Tensor, qw: formats.QuantWeights, ref: torch.Tensor, bias: torch.Tensor):
    """The docstring's bound, per output, in float64."""
    k = qw.in_features
    if qw.scheme in formats.INT4_SCHEMES:
        q = formats.unpack_int4(qw.weight).double()
        zero = 8.0 if qw.zero is None else qw.zero.double().repeat_interleave(qw.group_size, 1)
        scale = qw.scale.double().repeat_interleave(qw.group_size, 1)
        magnitude = (q.abs() + torch.as_tensor(zero).abs()) * scale
    else:
        magnitude = formats.dequantize(qw).double().abs()
    sums = x.double().abs() @ magnitude.T
    bound = (2 * k + 8) * 2.0**-24 * sums + 2.0**-23 * (ref.abs() + bias.double().abs())
    if _integer_form(qw.scheme, x.shape[0]):
        amax = x.double().abs().amax(dim=1, keepdim=True)
        moved = (amax / 32767).clamp(min=2.0**-127)
        bound = bound + moved * formats.dequantize(qw).double().abs().sum(1)
    return bound


SCHEMES = [
    ("int8_w8a16", 0, True),
    ("fp8_w8a16", 0, True),
    ("fp8_w8a16", 16, True),  # block-scaled checkpoints: a scale per row and group of k
    ("fp8_w8a16", 128, True),
    ("int4_w4a16", 128, True),
    ("int4_w4a16", 64, False),
    ("int4_w4a16", 32, False),
]


# int4 needs K a multiple of its group; the per-channel schemes take any K (a scalar tail)
SHAPES = [
    (*scheme, n, k)
    for scheme in SCHEMES
    for n, k in [(37, 40), (19, 20), (300, 256), (21, 1024)]
    if not scheme[1] or k % scheme[1] == 0
]


@needs_avx2
@pytest.mark.parametrize("scheme,group,symmetric,n,k", SHAPES)
@pytest.mark.parametrize("m", [0, 1, 2, 3, 8, 9, 16, 40])
def test_linear_quantw_matches_float64(avx2, scheme, group, symmetric, m, n, k):
    """Each scheme against x @ dequantize(qw)^T in float64, up to 8 rows in the register
    form (weight-row edges and odd row counts included) and past 8 in the panel form on
    the dequantized weight (N not a multiple of 16: a padded last panel)."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=gen)
    w[0, : (group or k) // 2] *= 1e-4  # fp8: subnormal codes (exponent 0) in row 0
    if scheme == "fp8_w8a16" and group:
        qw = _fp8_in_groups(w, group)
    else:
        qw = formats.quantize(w, scheme, group or 128, symmetric)
    if scheme == "fp8_w8a16":
        assert bool(((qw.weight & 0x78) == 0).any())
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    y = avx2.linear_quantw(x, qw.kind, qw.weight, qw.scale, qw.zero, qw.group_size, bias)
    assert y.shape == (m, n) and y.dtype == torch.float32
    ref = x.double() @ formats.dequantize(qw).double().T + bias.double()
    assert ((y.double() - ref).abs() <= _bound(x, qw, ref, bias) + 1e-30).all()


def _fp8_in_groups(w: torch.Tensor, group: int) -> formats.QuantWeights:
    """fp8 e4m3 with a scale per row and group of k (amax / 448), as block-scaled
    checkpoints hold after loading."""
    groups = w.unflatten(1, (-1, group))
    scale = groups.abs().amax(-1) / formats.FP8_MAX
    q = (groups / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).flatten(1)
    return formats.from_fp8_values(q, scale, group)


INTEGER_FORM = [("int8_w8a16", 0), ("int4_w4a16", 128), ("int4_w4a16", 32)]


@needs_avx2
@pytest.mark.parametrize("scheme,group", INTEGER_FORM)
@pytest.mark.parametrize("magnitude", [1e30, 1e-36])
@pytest.mark.parametrize("m", [1, 5])
def test_integer_form_holds_extreme_activations(avx2, scheme, group, magnitude, m):
    """The integer form's power-of-two block scales at both ends of fp32's range: rows near
    1e30 keep the relative bound; rows near 1e-36 (scales held at 2^-126, so that their
    inverse is finite) move by at most 2^-127 a value. K = 1000 puts int8's last 8 k on
    the fp32 tail."""
    gen = torch.Generator().manual_seed(m)
    k = 1024 if group else 1000
    qw = formats.quantize(torch.randn(24, k, generator=gen), scheme, group or 128)
    x = torch.randn(m, k, generator=gen) * magnitude
    y = avx2.linear_quantw(x, qw.kind, qw.weight, qw.scale, qw.zero, qw.group_size, None)
    ref = x.double() @ formats.dequantize(qw).double().T
    assert bool(torch.isfinite(y).all())
    assert ((y.double() - ref).abs() <= _bound(x, qw, ref, torch.zeros(24))).all()


@needs_avx2
@pytest.mark.parametrize("scheme,group", INTEGER_FORM)
@pytest.mark.parametrize("m", [1, 3])
def test_integer_form_propagates_nan_and_inf(avx2, scheme, group, m):
    """A NaN or an inf in a row of x makes every output of that row non-finite, as the
    float product does (the block's scale is NaN), and leaves the other rows alone."""
    gen = torch.Generator().manual_seed(7)
    qw = formats.quantize(torch.randn(20, 256, generator=gen), scheme, group or 128)
    x = torch.randn(m, 256, generator=gen)
    x[0, 5] = float("nan") if m == 1 else float("inf")
    y = avx2.linear_quantw(x, qw.kind, qw.weight, qw.scale, qw.zero, qw.group_size, None)
    assert not bool(torch.isfinite(y[0]).any())
    ref = x[1:].double() @ formats.dequantize(qw).double().T
    assert bool(torch.isfinite(y[1:]).all())
    assert ((y[1:].double() - ref).abs() <= _bound(x[1:], qw, ref, torch.zeros(20))).all()


@needs_avx2
@pytest.mark.parametrize("m", [1, 40])
def test_fp8_decoding_ignores_flush_to_zero(avx2, m):
    """fp8's subnormal codes decode exactly even when the caller's threads flush denormals
    (torch.set_flush_denormal sets MXCSR's DAZ/FTZ): the vector decode goes through fp16
    (normal in fp32), the scalar tail (K % 16) through fp32 subnormals, which the op keeps
    by clearing DAZ/FTZ for the call and restoring the caller's setting. Rows of positive
    subnormal codes only (0x01-0x07, m * 2^-9) with positive x: flushed, every output
    would be 0; K = 231 (a 7-k tail); 64 rows so both threads' chunks run."""
    codes = torch.arange(1, 8, dtype=torch.uint8).repeat(33)  # K = 231
    qw = formats.from_fp8_values(codes.repeat(64, 1), torch.ones(64))
    x = torch.rand(m, 231) + 0.5
    ref = x.double() @ formats.dequantize(qw).double().T
    assert bool((ref > 0).all())
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        y = avx2.linear_quantw(x, qw.kind, qw.weight, qw.scale, None, 0, None)
        still_flushing = torch.tensor([1e-39]) * 1.0
    finally:
        torch.set_flush_denormal(False)
    assert torch.allclose(y.double(), ref, rtol=1e-6, atol=0)
    assert float(still_flushing) == 0.0  # the caller's MXCSR restored


@needs_avx2
@pytest.mark.parametrize("group", [2048, 4096])
@pytest.mark.parametrize("weight,symmetric", [(1.0, True), (1.0, False), (-1.0, False)])
@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("m", [1, 3])
def test_int4_integer_sums_hold_the_largest_groups(avx2, group, weight, symmetric, sign, m):
    """The integer form's int32 sums at their largest: one group of 2048 k (the largest the
    16-bit-word unit takes: its sixteen-times sums reach 2.0e9) and of 4096 (past it:
    Int4Pair), every q at 15 or 0 and every x rounded to +-32766 (15.999 = 32766 2^-11),
    so the products' sums and z sum_k q_x are as large as they get: symmetric q = 15
    (z = 8), asymmetric q = 15 with z = 0 and q = 0 with z = 15. Overflow would wrap an
    int32 and miss the float64 result by ~2^32 quanta."""
    qw = formats.quantize(torch.full((4, group), weight), "int4_w4a16", group, symmetric)
    q = formats.unpack_int4(qw.weight)
    zero = 8.0 if qw.zero is None else float(qw.zero[0, 0])
    assert bool((q == q[0, 0]).all()) and (int(q[0, 0]), zero) in ((15, 8.0), (15, 0.0), (0, 15.0))
    x = torch.full((m, group), sign * 15.999)
    y = avx2.linear_quantw(x, qw.kind, qw.weight, qw.scale, qw.zero, qw.group_size, None)
    ref = x.double() @ formats.dequantize(qw).double().T
    assert ((y.double() - ref).abs() <= _bound(x, qw, ref, torch.zeros(4))).all()


@needs_avx2
def test_linear_quantw_rejects_bad_operands(avx2):
    qw = formats.quantize(torch.randn(8, 64), "int4_w4a16", 32)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="kind"):
        avx2.linear_quantw(x, 9, qw.weight, qw.scale, None, 32, None)
    with pytest.raises(RuntimeError, match="groups"):
        avx2.linear_quantw(x, qw.kind, qw.weight, qw.scale, None, 48, None)
    with pytest.raises(RuntimeError, match="row size"):
        avx2.linear_quantw(torch.randn(2, 32), qw.kind, qw.weight, qw.scale, None, 32, None)
    with pytest.raises(RuntimeError, match="scale"):
        avx2.linear_quantw(x, qw.kind, qw.weight, qw.scale[:4], None, 32, None)
    with pytest.raises(RuntimeError, match="bias"):
        avx2.linear_quantw(x, qw.kind, qw.weight, qw.scale, None, 32, torch.ones(1))


@needs_avx2
@pytest.mark.parametrize("m", [1, 5, 9, 40])
def test_int8_w8a8_in_fp32_matches_the_reference_exactly(avx2, m):
    """int8_w8a8 in an fp32 engine (`QuantizedLinearMethod._apply_fp32`): the quantized
    activations' integer sums are exact in fp32 (below 2^24), then scaled in the
    reference's order, so the result equals `formats.reference_linear` bit for bit."""
    from minivllm.quantization.config import SchemeSpec
    from minivllm.quantization.method import QuantizedLinearMethod

    gen = torch.Generator().manual_seed(m)
    qw = formats.quantize(torch.randn(48, 256, generator=gen), "int8_w8a8")
    method = QuantizedLinearMethod(SchemeSpec("int8_w8a8"))
    method.fp32_op, method.quant_weights = avx2.linear_quantw, qw
    x, bias = torch.randn(m, 256, generator=gen), torch.randn(48, generator=gen)
    ours = method._apply_fp32(x, qw, bias)
    assert torch.equal(ours, formats.reference_linear(x, qw, bias))


def _w4a8_x(x: torch.Tensor, group: int) -> torch.Tensor:
    """int4_w4a8's activations as the values they stand for, xq * xs, in float64."""
    xq, xs = formats.quantize_per_group(x, group)
    return xq.double() * xs.double().repeat_interleave(group, -1)


@needs_avx2
@pytest.mark.parametrize(
    "group,symmetric", [(128, True), (64, False), (256, True), (512, False), (32, True)]
)
@pytest.mark.parametrize("m", [0, 1, 3, 8, 9, 40])
def test_int4_w4a8_matches_its_reference(avx2, group, symmetric, m):
    """int4_w4a8 (kind 5): x rounded to int8 per row and group (formats.quantize_per_group,
    the kernel's rounding with the same fp32 operations), then the exact product of those
    values with the int4 weight. Up to 8 rows the kernel sums the integers exactly (in
    int16 for up to 256 k, |sum| <= 8 * 3810, then int32) and scales each group's sum; past
    8 rows, and for groups of 32, it multiplies the rounded values in the panel form. Both
    are within the module's bound of `reference_linear`, taken on the rounded x. The same
    bound around the unrounded product fails somewhere: the test tells the schemes apart."""
    k, n = 1024, 37
    gen = torch.Generator().manual_seed(m * 10 + group)
    qw = formats.quantize(torch.randn(n, k, generator=gen), "int4_w4a8", group, symmetric)
    assert qw.kind == formats.KIND_INT4_W4A8
    x = torch.randn(m, k, generator=gen)
    x[:, :8] *= 30  # an outlier channel: per-group scales keep it to its own group
    bias = torch.randn(n, generator=gen)
    y = avx2.linear_quantw(x, qw.kind, qw.weight, qw.scale, qw.zero, qw.group_size, bias)
    ref = formats.reference_linear(x, qw, bias).double()
    xd = _w4a8_x(x, group)
    bound = _bound(xd, qw, ref, bias) + 1e-30
    assert ((y.double() - ref).abs() <= bound).all()
    if m:
        unrounded = x.double() @ formats.dequantize(qw).double().T + bias.double()
        assert ((y.double() - unrounded).abs() > bound).any()


@needs_avx2
@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("m", [1, 4, 12])
def test_int4_w4a8_rounds_x_as_the_reference_does(avx2, group, m):
    """Every x rounded to the same integer as formats.quantize_per_group: at K = 128 the
    float error bound is ~1e-5 of the sum while one unit of x's rounding moves an output by
    xs |w_k| (~1e-2 of it). bf16-valued x (few mantissa bits) lands near the .5 boundaries
    often; 64 draws of each shape (the reference once computed 127 / amax as a reciprocal
    times 127, two roundings, and every shape here caught it)."""
    k, n = 128, 16
    gen = torch.Generator().manual_seed(group + m)
    qw = formats.quantize(torch.randn(n, k, generator=gen), "int4_w4a8", group, False)
    for _ in range(64):
        x = torch.randn(m, k, generator=gen).bfloat16().float()
        y = avx2.linear_quantw(x, qw.kind, qw.weight, qw.scale, qw.zero, qw.group_size, None)
        ref = formats.reference_linear(x, qw).double()
        bound = _bound(_w4a8_x(x, group), qw, ref, torch.zeros(n)) + 1e-30
        assert ((y.double() - ref).abs() <= bound).all()


@needs_avx2
@pytest.mark.parametrize("m", [1, 9])
def test_int4_w4a8_int16_sums_hold_at_their_largest(avx2, m):
    """The int16 lanes at their limit: q = 15 (asymmetric, zero 0) against x at +-127 in
    every k of a 256-k run, so each lane adds 8 pair products of 2 * 15 * 127 = 3810
    (30480 < 32767); a wrap would be off by 65536 in a lane."""
    k = 512
    gen = torch.Generator().manual_seed(m)
    q = torch.full((3, k), 15, dtype=torch.uint8)
    q[1] = 0
    q[2, ::2] = 7
    qw = formats.from_int4_values(
        q, torch.full((3, k // 256), 0.5), torch.zeros(3, k // 256), 256, "int4_w4a8"
    )
    sign = torch.where(torch.rand(m, k, generator=gen) < 0.5, -1.0, 1.0)
    x = torch.ones(m, k) * 3.0
    x[1:] *= sign[1:]
    y = avx2.linear_quantw(x, qw.kind, qw.weight, qw.scale, qw.zero, qw.group_size, None)
    ref = formats.reference_linear(x, qw).double()
    assert ((y.double() - ref).abs() <= 1e-6 * ref.abs().clamp(min=1)).all()


@needs_avx2
@pytest.mark.parametrize("m,n,k", [(1, 37, 40), (3, 64, 96), (40, 300, 256)])
def test_linear_int8w_keeps_its_contract(avx2, m, n, k):
    """`linear_int8w`, the earlier name of int8's op: (x q^T) * scale + bias."""
    gen = torch.Generator().manual_seed(m + n)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    scale = torch.rand(n, generator=gen) / 64
    bias = torch.randn(n, generator=gen)
    x = torch.randn(m, k, generator=gen)
    qw = formats.from_int8_values(q, scale)
    ref = (x.double() @ q.double().T) * scale.double() + bias.double()
    y = avx2.linear_int8w(x, q, scale, bias)
    assert ((y.double() - ref).abs() <= _bound(x, qw, ref, bias) + 1e-30).all()


@needs_avx2
@pytest.mark.parametrize(
    "scheme,options",
    [
        ("int8_w8a16", {}),
        ("int4_w4a16", {"group_size": 32, "symmetric": False}),
        ("fp8_w8a16", {}),
        ("int8_w8a8", {}),
        ("int4_w4a8", {"group_size": 64}),
    ],
)
def test_quantized_fp32_engine_runs_the_avx2_op_and_agrees_with_the_reference(
    make_checkpoint, scheme, options, caplog
):
    """Every scheme in an fp32 engine: the AVX2 op, not the reference that dequantizes every
    weight at every call; both compute in fp32 on the same numbers (int8_w8a8: the same
    quantized activations), so greedy tokens match and prompt logprobs agree to 1e-4 (1e-3
    where the integer form rounds x to int16).
    Prompts of 7 and 30 tokens put prefill on both of the op's paths."""
    from minivllm import LLM, SamplingParams
    from minivllm.kernels.isa import AVX512_VNNI_FLAGS, cpu_flags

    fp32_vnni = AVX512_VNNI_FLAGS <= cpu_flags()
    model_dir = make_checkpoint("Qwen3ForCausalLM")
    prompts = [[5, 9, 33, 120, 7, 8, 9], list(range(40, 70))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    runs = {}
    caplog.set_level("INFO", logger="minivllm")
    for backend in ("cpu_kernel", "torch"):
        llm = LLM(
            str(model_dir),
            dtype="float32",
            quantization="online",
            quantization_config={"targets": {"*": {"scheme": scheme, **options}}},
            kernel_config={"linear_backend_per_quant": {scheme: backend}},
            kv_cache_memory_bytes=8 << 20,
            max_model_len=128,
            enable_prefix_caching=False,
        )
        op = "the AVX2 family's linear_quantw" if backend == "cpu_kernel" else "the plain-PyTorch"
        if backend == "cpu_kernel" and scheme == "int8_w8a8" and fp32_vnni:
            op = "the AVX2 family's vnni_w8a8_linear"  # AVX-512 CPUs with VNNI (test_avx2_vnni.py)
        logged = rf"{scheme}: \d+ layers on {backend} \({op}.*, as linear_backend_per_quant asks"
        assert re.search(logged, caplog.text), caplog.text
        caplog.clear()
        down = llm.llm_engine.executor.runner.model.model.layers[0].mlp.down_proj
        assert down.quant_method.spec.scheme == scheme
        assert down.quant_method.backend == backend
        assert (down.quant_method.fp32_op is not None) == (backend == "cpu_kernel")
        runs[backend] = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    # the prefill's 37 rows in the integer form (int8 on AVX512-VNNI CPUs) round x to int16
    # at each linear, 2^-16 of a 128-k block's largest value: on this tiny random model
    # that moved a logprob by up to 2.1e-4 (2026-12-08), against ~1e-2 for bf16
    # activations; elsewhere both sides compute in fp32 and differ by summation order
    tolerance = 1e-3 if _integer_form(scheme, sum(map(len, prompts))) else 1e-4
    for ours, ref in zip(runs["cpu_kernel"], runs["torch"], strict=True):
        assert ours.outputs[0].token_ids == ref.outputs[0].token_ids
        for pos in range(1, len(ours.prompt_token_ids)):
            token = ours.prompt_token_ids[pos]
            diff = (
                ours.prompt_logprobs[pos][token].logprob - ref.prompt_logprobs[pos][token].logprob
            )
            assert abs(diff) < tolerance, (pos, diff)
