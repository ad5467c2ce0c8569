"""`amx_weight_only_linear` (kernels/amx_weight_only.cpp): weight-only int8, fp8 and int4
batches on AMX-BF16 tiles, and the routing that hands them to it.

Two oracles. `reference_linear` within test_quant_kernels' derived bound (the kernel sums
the same exact products in another float32 order, int4 with its 128 + n offsets undone per
group, and rounds once to bf16). And exact arithmetic: with small-integer activations and
power-of-two scales every product and every float32 partial sum is an integer below 2^24,
so the kernel's output must equal the float64 product rounded to bf16 bit for bit; a tile
or a k pair out of place, a group's offset misapplied or a row of x lost cannot hide
inside a rounding bound there.
"""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels import get_cpu_kernels
from minivllm.quantization import formats, kernel_limits
from minivllm.quantization.formats import quantize
from tests.test_quant_kernels import _assert_fused_equals_per_layer, assert_matches_reference


def _amx_kernels():
    kernels = get_cpu_kernels()
    if kernels is None or not kernels.amx_bf16_available():
        pytest.skip("needs AMX-BF16 (Intel Sapphire Rapids or later) and the bf16 kernels")
    return kernels


# (scheme, symmetric, group): the weight formats the kernel takes
FORMATS = [
    ("int8_w8a16", True, 0),
    ("fp8_w8a16", True, 0),
    ("int4_w4a16", True, 128),
    ("int4_w4a16", False, 128),
    ("int4_w4a16", False, 256),
]
# (N, K): N leaves a partial block of 16 rows (37, 100, 13); K of 96 and 160 end on a partial
# 128-k decode unit (int8, fp8); int4's K are whole groups
SHAPES = [(37, 256), (64, 1024), (100, 512), (13, 768)]
SHAPES_PER_CHANNEL = [(13, 96), (50, 160)]
# rows of x: a pass takes up to 64 (four C tiles); 65 and 130 leave partial passes and tiles
ROWS = [1, 5, 16, 17, 64, 65, 130]


def _shapes(scheme: str, group: int) -> list[tuple[int, int]]:
    shapes = [(n, k) for n, k in SHAPES if k % (group or 1) == 0]
    return shapes + (SHAPES_PER_CHANNEL if group == 0 else [])


@pytest.mark.parametrize("scheme,symmetric,group", FORMATS)
def test_matches_the_reference_within_its_bound(scheme, symmetric, group):
    kernels = _amx_kernels()
    for n, k in _shapes(scheme, group):
        gen = torch.Generator().manual_seed(n * k + group)
        qw = quantize(torch.randn(n, k, generator=gen), scheme, group or 128, symmetric)
        bias = torch.randn(n, generator=gen).bfloat16()
        for rows in ROWS:
            x = (2 * torch.randn(rows, k, generator=gen)).bfloat16()
            for b in (None, bias):
                got = kernels.amx_weight_only_linear(
                    x, qw.kind, qw.weight, qw.scale, qw.zero, qw.group_size, b
                )
                assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
                assert_matches_reference(got, x, qw, b)


def _exact_weights(scheme: str, symmetric: bool, group: int, n: int, k: int, gen):
    """Integer-valued weights with power-of-two scales, in `scheme`'s storage."""
    if scheme == "int4_w4a16":
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        scale = 2.0 ** torch.randint(-3, 3, (n, k // group), generator=gen).float()
        zero = None if symmetric else torch.randint(0, 16, (n, k // group), generator=gen).float()
        return formats.from_int4_values(q, scale, zero, group)
    scale = 2.0 ** torch.randint(-3, 3, (n,), generator=gen).float()
    if scheme == "fp8_w8a16":
        # e4m3 integers 0..15 (exact), and a few of its subnormals: m * 2^-9 times 2^9
        q = torch.randint(-15, 16, (n, k), generator=gen).float()
        q[:, ::7] = torch.randint(-7, 8, (n, len(range(0, k, 7))), generator=gen) * 2.0**-9
        return formats.from_fp8_values(q.to(torch.float8_e4m3fn), scale * 1.0)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    return formats.from_int8_values(q, scale)


@pytest.mark.parametrize("scheme,symmetric,group", FORMATS)
def test_small_integers_come_out_exact(scheme, symmetric, group):
    kernels = _amx_kernels()
    for n, k in _shapes(scheme, group):
        gen = torch.Generator().manual_seed(7 * n + k)
        qw = _exact_weights(scheme, symmetric, group, n, k, gen)
        bias = torch.randint(-50, 50, (n,), generator=gen).bfloat16()
        for rows in ROWS:
            x = torch.randint(-4, 5, (rows, k), generator=gen).bfloat16()
            want = (x.double() @ formats.dequantize(qw).double().T + bias.double()).bfloat16()
            got = kernels.amx_weight_only_linear(
                x, qw.kind, qw.weight, qw.scale, qw.zero, qw.group_size, bias
            )
            assert torch.equal(got, want), (scheme, n, k, rows)


def test_bad_operands_are_refused():
    kernels = _amx_kernels()
    x = torch.randn(4, 256).bfloat16()
    qw = quantize(torch.randn(32, 256), "int4_w4a16", 64)
    with pytest.raises(RuntimeError, match="not one it takes"):  # groups of 64
        kernels.amx_weight_only_linear(x, qw.kind, qw.weight, qw.scale, qw.zero, 64, None)
    q8 = quantize(torch.randn(32, 256), "int8_w8a16")
    with pytest.raises(RuntimeError, match="weight must be"):
        kernels.amx_weight_only_linear(x[:, :128], q8.kind, q8.weight, q8.scale, None, 0, None)
    with pytest.raises(RuntimeError, match="scale must be"):
        kernels.amx_weight_only_linear(x, q8.kind, q8.weight, q8.scale[:16], None, 0, None)


def test_which_weights_it_takes():
    take = kernel_limits.amx_weight_only_takes
    w = torch.randn(32, 512)
    assert take(quantize(w, "int8_w8a16")) and take(quantize(w, "fp8_w8a16"))
    assert take(quantize(w, "int4_w4a16", 128)) and take(quantize(w, "int4_w4a16", 256))
    assert not take(quantize(w, "int4_w4a16", 64))  # groups inside its 128-k unit
    assert not take(quantize(w, "int8_w8a8"))  # its own int8 GEMMs
    assert not take(quantize(w, "int4_w4a8", 128))
    # the limits it changes: quant_linear streams fewer rows before it
    qw = quantize(w, "int8_w8a16")
    assert (
        kernel_limits.max_kernel_rows(qw, amx=True)
        == kernel_limits.AMX_MAX_STREAMING_ROWS["int8_w8a16"]
    )
    assert kernel_limits.max_kernel_rows(qw) == kernel_limits.MAX_STREAMING_ROWS["int8_w8a16"]


@pytest.mark.parametrize("scheme,group", [("int8_w8a16", 0), ("int4_w4a16", 128)])
def test_the_linear_method_routes_batches_to_it(scheme, group):
    """QuantizedLinearMethod.apply on an AMX CPU: quant_linear up to its rows, the AMX kernel
    from there to AMX_WEIGHT_ONLY_MAX_ROWS, dequantize + GEMM past them; each output the
    op's own, bit for bit."""
    kernels = _amx_kernels()
    from minivllm.kernels.registry import select_kernels
    from minivllm.quantization.config import SchemeSpec
    from minivllm.quantization.method import QuantizedLinearMethod

    qw = quantize(torch.randn(96, 512), scheme, group or 128)
    method = QuantizedLinearMethod(SchemeSpec(scheme, group or 128))
    method.use(qw, select_kernels("cpu", torch.bfloat16))
    assert method.amx_op is not None and "AMX-BF16" in method.op_name
    streamed = kernel_limits.AMX_MAX_STREAMING_ROWS[scheme]
    assert method.kernel_rows == streamed
    assert method.amx_rows == kernel_limits.AMX_WEIGHT_ONLY_MAX_ROWS
    args = (qw.kind, qw.weight, qw.scale, qw.zero)
    dense = torch.empty(96, 512, dtype=torch.bfloat16)
    kernels.dequantize_bf16(*args, qw.group_size, dense)
    for rows in (streamed, streamed + 1, 64, method.amx_rows, method.amx_rows + 1):
        x = torch.randn(rows, 512).bfloat16()
        got = method.apply(None, x, None)
        if rows <= streamed:
            want = kernels.quant_linear(x, *args, None, qw.group_size, None)
        elif rows <= method.amx_rows:
            want = kernels.amx_weight_only_linear(x, *args, qw.group_size, None)
        else:
            want = torch.nn.functional.linear(x, dense)
        assert torch.equal(got, want), rows


@pytest.mark.parametrize(
    "quantization,config",
    [
        ("int8", None),
        ("fp8", None),
        ("online", {"targets": {"re:.*": "int4_w4a16"}, "ignore": ["lm_head"]}),
    ],
)
def test_the_fused_decode_step_runs_it_as_the_layers_do(make_checkpoint, quantization, config):
    """An engine quantized online on an AMX CPU: decode batches past the streaming rows run
    the AMX kernel in the one-call step as in the per-layer path, so the two agree bit for
    bit (tokens and logprobs; a step on another kernel rounds otherwise somewhere in 20
    sequences' logprobs)."""
    _amx_kernels()
    from minivllm import LLM
    from minivllm.layers.fused_decode import AMX_WEIGHT_ONLY_ROWS, FusedLlamaDecode

    # hidden and intermediate sizes that int4's 128-k groups divide
    model_dir = make_checkpoint(
        "Qwen3ForCausalLM", dtype=torch.bfloat16, hidden_size=128, intermediate_size=256
    )
    llm = LLM(
        str(model_dir),
        dtype="bfloat16",
        quantization=quantization,
        quantization_config=config,
        kv_cache_memory_bytes=8 << 20,
        max_model_len=64,
        block_size=4,
        enable_prefix_caching=False,
    )
    runner = llm.llm_engine.executor.runner
    fused_step, _ = FusedLlamaDecode.build(runner.model, runner.kernels, runner.attn_backend)
    assert fused_step.max_quant_rows[AMX_WEIGHT_ONLY_ROWS] == kernel_limits.AMX_WEIGHT_ONLY_MAX_ROWS
    _assert_fused_equals_per_layer(llm)  # 20 sequences a step, then 3


def test_the_fused_decode_step_keeps_each_int4_layer_on_its_own_route(make_checkpoint):
    """int4 in groups of 128 (the AMX kernel's) beside groups of 64 (not its): per layer,
    quant_linear keeps 2 rows before the AMX kernel on the first and 4 on the second, then
    dequantized_linear; the one-call step takes each layer's own route, so it equals the
    per-layer path bit for bit with 3 and with 20 sequences a step."""
    _amx_kernels()
    from minivllm import LLM

    model_dir = make_checkpoint(
        "Qwen3ForCausalLM", dtype=torch.bfloat16, hidden_size=128, intermediate_size=256
    )
    g64 = {"scheme": "int4_w4a16", "group_size": 64}
    llm = LLM(
        str(model_dir),
        dtype="bfloat16",
        quantization="online",
        quantization_config={
            "targets": {"re:.*mlp.*": "int4_w4a16", "re:.*self_attn.*": g64},
            "ignore": ["lm_head"],
        },
        kv_cache_memory_bytes=8 << 20,
        max_model_len=64,
        block_size=4,
        enable_prefix_caching=False,
    )
    runner = llm.llm_engine.executor.runner
    methods = [
        lin.quant_method
        for layer in runner.model.decoder_stack_parts().layers
        for lin in layer.linears
    ]
    assert {m.kernel_rows for m in methods if m.amx_op is not None} == {2}
    assert {m.kernel_rows for m in methods if m.amx_op is None} == {4}
    _assert_fused_equals_per_layer(llm)
