"""The bf16 CPU GEMV kernel against a float64 reference, and the engine with it on and off."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.kernels import cpu_has_avx512_bf16, get_cpu_kernels

needs_kernel = pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="CPU lacks AVX512-BF16")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("n,k", [(64, 1024), (37, 200), (1000, 96)])
def test_gemv_matches_a_float64_reference(rows, n, k):
    kernels = get_cpu_kernels()
    assert kernels is not None
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    ref = x.double() @ w.double().T + bias.double()
    got = kernels.gemv_bf16(x, w, bias).double()
    # fp32 accumulation, one bf16 rounding of the result: relative error ~2^-8
    scale = x.double().abs() @ w.double().abs().T + bias.double().abs()
    assert ((got - ref).abs() <= scale * 2**-7 + 1e-6).all()


@needs_kernel
def test_engine_outputs_agree_with_and_without_kernels(qwen3_dir):
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11]}, {"prompt_token_ids": [40, 41, 42]}]
    logprobs = {}
    for enabled in (False, True):
        llm = LLM(
            str(qwen3_dir),
            dtype="bfloat16",
            kv_cache_memory_bytes=4 << 20,
            max_model_len=64,
            cpu_kernels=enabled,
        )
        linear = llm.llm_engine.executor.runner.model.model.layers[0].mlp.down_proj
        assert (type(linear.quant_method).__name__ == "CpuGemvLinearMethod") == enabled
        outs = llm.generate(
            prompts,
            SamplingParams(temperature=0, max_tokens=4, logprobs=5, ignore_eos=True),
            use_tqdm=False,
        )
        logprobs[enabled] = [o.outputs[0].logprobs[0] for o in outs]
    for off, on in zip(logprobs[False], logprobs[True]):
        common = set(off) & set(on)
        assert len(common) >= 3
        for token in common:
            assert on[token].logprob == pytest.approx(off[token].logprob, abs=0.05)
