"""int8_w8a8 in fp32 engines on AVX-512 CPUs with VNNI and without AVX512-BF16 (Intel Ice
Lake, Cascade Lake): the AVX2 family's VNNI GEMM (`kernels/avx2_vnni.cpp`, vnni_gemm.h).

Its numbers are the reference's exactly: x is quantized per token with the reference's
fp32 operations, the integer sums are exact in int32, and the scaling is the reference's
two rounded products and the bias add. So the oracle is `formats.reference_linear`, and
the comparison is equality.
"""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels.isa import AVX512_VNNI_FLAGS, cpu_flags
from minivllm.quantization import formats, kernel_limits, packing
from tests.conftest import needs_avx2

needs_fp32_vnni = pytest.mark.skipif(
    not AVX512_VNNI_FLAGS <= cpu_flags(), reason="CPU lacks AVX512-VNNI"
)


def _layer(n: int, k: int, seed: int) -> formats.QuantWeights:
    gen = torch.Generator().manual_seed(seed)
    qw = formats.quantize(torch.randn(n, k, generator=gen), "int8_w8a8")
    packing.prepack_w8a8(qw, "vnni")
    return qw


@needs_avx2
@needs_fp32_vnni
@pytest.mark.parametrize(
    "m,n,k",
    [
        (0, 40, 128),
        (1, 40, 128),  # one panel, 8 rows of it past N
        (5, 70, 96),  # K not a multiple of 64
        (12, 64, 256),  # one whole tile
        (13, 100, 256),  # a tile and a row
        (25, 33, 16),  # the smallest K
        (300, 48, 2048),  # past a chunk of x (192 rows at this K)
    ],
)
def test_vnni_gemm_fp32_equals_the_reference(avx2, m, n, k):
    qw = _layer(n, k, m + n + k)
    gen = torch.Generator().manual_seed(1)
    x, bias = 3 * torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    for b in (None, bias):
        got = avx2.vnni_w8a8_linear(x, qw.packed, k, qw.scale, qw.wsum, b)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        assert torch.equal(got, formats.reference_linear(x, qw, b))


@needs_avx2
@needs_fp32_vnni
def test_vnni_gemm_fp32_equals_the_reference_over_many_scales(avx2):
    """A reassociated epilogue, acc * (xs * scale), differs from the reference's
    (acc * xs) * scale in the last bit now and then; over 20 seeded scales and 192,000
    outputs a single flip fails the test. Rows of zeros (scale 1) and of one large value
    (the clamp at 127) are among them."""
    q = torch.randint(-128, 128, (48, 1024), generator=torch.Generator().manual_seed(0))
    x = 3 * torch.randn(200, 1024, generator=torch.Generator().manual_seed(1))
    x[7] = 0
    x[8, 5] = 1e6
    for seed in range(20):
        scale = torch.rand(48, generator=torch.Generator().manual_seed(seed)) / 100
        qw = formats.from_int8_values(q.to(torch.int8), scale, "int8_w8a8")
        packing.prepack_w8a8(qw, "vnni")
        got = avx2.vnni_w8a8_linear(x, qw.packed, 1024, qw.scale, qw.wsum, None)
        want = formats.reference_linear(x, qw, None)
        assert torch.equal(got, want), f"seed {seed}: {(got != want).sum()} outputs differ"


@needs_avx2
def test_the_compiled_packer_writes_packings_layout(avx2):
    """The AVX2 family's pack_vnni_w8a8 (kernels/pack_weights.cpp) against
    packing.pack_vnni_w8a8, which defines the layout, byte for byte."""
    q = torch.randint(-128, 128, (70, 96), generator=torch.Generator().manual_seed(3))
    q = q.to(torch.int8)
    out = torch.empty(
        packing.packed_shape(formats.from_int8_values(q, torch.ones(70)), "vnni"), dtype=torch.int8
    )
    avx2.pack_vnni_w8a8(q, out)
    assert torch.equal(out, packing.pack_vnni_w8a8(q))


@needs_avx2
@needs_fp32_vnni
def test_vnni_gemm_fp32_rejects_mismatched_inputs(avx2):
    qw = _layer(40, 128, 1)
    x = torch.randn(3, 128)

    def call(**overrides):
        args = dict(x=x, packed=qw.packed, k=128, scale=qw.scale, wsum=qw.wsum, bias=None)
        args.update(overrides)
        return avx2.vnni_w8a8_linear(*args.values())

    assert call().shape == (3, 40)
    for overrides, message in [
        (dict(x=torch.randn(3, 96)), "x has K=96, the weight 128"),
        (dict(x=x.bfloat16()), "x must be float32"),
        (dict(scale=torch.ones(80), wsum=torch.zeros(80, dtype=torch.int32)), "scale has N=80"),
        (dict(wsum=qw.wsum[:4]), "wsum must be int32"),
        (dict(packed=qw.weight), "pack_vnni_w8a8"),
        (dict(bias=torch.ones(3)), "bias must be float32"),
        (dict(bias=torch.ones(40).bfloat16()), "bias must be float32"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            call(**overrides)


@needs_avx2
def test_fp32_vnni_is_offered_only_where_the_cpu_has_it(monkeypatch):
    """kernel_limits.fp32_vnni_takes: int8_w8a8, K a multiple of 16, and the four
    extensions; MINIVLLM_CPU_ISA=avx2 (an AVX2-only machine's estimate) takes it away."""
    from minivllm.kernels import isa

    qw = _layer(32, 64, 0)
    has = AVX512_VNNI_FLAGS <= isa.cpu_flags()
    assert kernel_limits.fp32_vnni_takes(qw) == has
    odd = formats.quantize(torch.randn(32, 40), "int8_w8a8")
    assert not kernel_limits.fp32_vnni_takes(odd)
    assert not kernel_limits.fp32_vnni_takes(formats.quantize(torch.randn(32, 64), "int8_w8a16"))
    monkeypatch.setenv("MINIVLLM_CPU_ISA", "avx2")
    isa.cpu_flags.cache_clear()
    try:
        assert not kernel_limits.fp32_vnni_takes(qw)
    finally:
        monkeypatch.delenv("MINIVLLM_CPU_ISA")
        isa.cpu_flags.cache_clear()


@needs_avx2
@needs_fp32_vnni
def test_fp32_engine_runs_int8_w8a8_on_the_vnni_gemm(make_checkpoint, caplog):
    """An fp32 engine (dtype float32: what such a CPU's engine runs) takes int8_w8a8 on the
    VNNI GEMM at every batch: the layers hold the packed panels (the weight cache's buffer)
    and no row copy, say so in the log, and give the plain-PyTorch reference's greedy
    tokens and prompt logprobs (the same numbers: both quantize x the same way)."""
    import re

    from minivllm import LLM, SamplingParams

    model_dir = make_checkpoint("Qwen3ForCausalLM")
    prompts = [[5, 9, 33, 120, 7, 8, 9], list(range(40, 70))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    caplog.set_level("INFO", logger="minivllm")
    llm = LLM(
        str(model_dir),
        dtype="float32",
        quantization="online",
        quantization_config={"targets": {"*": "int8_w8a8"}},
        kv_cache_memory_bytes=8 << 20,
        max_model_len=128,
        enable_prefix_caching=False,
    )
    assert re.search(
        r"int8_w8a8: \d+ layers on cpu_kernel \(the AVX2 family's vnni_w8a8_linear", caplog.text
    ), caplog.text
    down = llm.llm_engine.executor.runner.model.model.layers[0].mlp.down_proj
    qw = down.quant_method.quant_weights
    assert qw.packed is not None and not qw.has_rows
    assert down.packed is qw.packed
    ours = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    del llm
    ref_llm = LLM(
        str(model_dir),
        dtype="float32",
        quantization="online",
        quantization_config={"targets": {"*": "int8_w8a8"}},
        kernel_config={"linear_backend_per_quant": {"int8_w8a8": "torch"}},
        kv_cache_memory_bytes=8 << 20,
        max_model_len=128,
        enable_prefix_caching=False,
    )
    ref = ref_llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for a, b in zip(ours, ref, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pos in range(1, len(a.prompt_token_ids)):
            token = a.prompt_token_ids[pos]
            diff = a.prompt_logprobs[pos][token].logprob - b.prompt_logprobs[pos][token].logprob
            assert abs(diff) < 1e-4, (pos, diff)
