"""The AVX2 family (CPUs without AVX-512): fp32 activations over bf16 weight panels, and
fp32 paged decode attention (`kernels/avx2_linear.cpp`, `kernels/avx2_attention.cpp`).

AVX2 code runs on AVX-512 CPUs too, so these tests run wherever AVX2 + FMA is present:
the kernels are checked against float64 references and the torch backend, and a whole
engine on panels against transformers in fp32 on the same (bf16-valued) weights.

Tolerance of the linear kernel: it sums K exact products (bf16 weight x fp32 activation
fits a double exactly; in fp32 each product rounds once) in fp32 in another order than
the float64 reference, so |y - y64| <= 2 K 2^-24 sum_k |x_k w_k| + |bias| 2^-24, the
textbook bound for recursive summation; the test uses that bound.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from minivllm.layers.panel_linear import exactly_bf16, pack_panels, unpack_panels
from tests.conftest import needs_avx2


def bf16_valued(*shape: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).bfloat16().float()


def test_panels_round_trip_and_the_exactness_check():
    for n, k in [(1, 1), (16, 8), (37, 40), (300, 33)]:
        w = bf16_valued(n, k, seed=n)
        panels = pack_panels(w)
        assert panels.shape == (-(-n // 16), k, 16) and panels.dtype == torch.bfloat16
        assert torch.equal(unpack_panels(panels, n), w)
        # pair j of a panel's step k is (row j, row 8 + j)
        assert panels[0, 0, 0].item() == w[0, 0].item()
        if n > 8:
            assert panels[0, 0, 1].item() == w[8, 0].item()
    assert exactly_bf16(bf16_valued(4, 4))
    assert not exactly_bf16(torch.randn(64, 64))  # an fp32 checkpoint's values
    assert not exactly_bf16(bf16_valued(4, 4).half())  # another dtype: no panels


@needs_avx2
@pytest.mark.parametrize("n,k", [(16, 8), (37, 40), (1024, 96), (200, 333), (5000, 1024)])
@pytest.mark.parametrize("m", [0, 1, 2, 5, 6, 7, 13, 70, 200])
def test_linear_bf16w_matches_float64(avx2, m, n, k):
    """Up to 127 rows the panel kernel, from 128 ATen's GEMM on the widened weight (in
    slices of 16 MB: the 5000 x 1024 case takes two)."""
    w = bf16_valued(n, k, seed=1)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(n)
    y = avx2.linear_bf16w(x, pack_panels(w), n, bias)
    assert y.shape == (m, n) and y.dtype == torch.float32
    ref = x.double() @ w.double().T + bias.double()
    bound = (
        2 * k * 2.0**-24 * (x.double().abs() @ w.double().abs().T) + bias.double().abs() * 2.0**-23
    )
    assert ((y.double() - ref).abs() <= bound + 1e-30).all()


@needs_avx2
def test_linear_bf16w_rejects_bad_shapes(avx2):
    panels = pack_panels(bf16_valued(32, 8))
    with pytest.raises(RuntimeError, match="n does not match"):
        avx2.linear_bf16w(torch.randn(1, 8), panels, 40, None)
    with pytest.raises(RuntimeError, match="K"):
        avx2.linear_bf16w(torch.randn(1, 9), panels, 32, None)
    with pytest.raises(RuntimeError, match="float32"):
        avx2.linear_bf16w(torch.randn(1, 8).bfloat16(), panels, 32, None)


@needs_avx2
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 4, 2), (80, 6, 1), (128, 8, 8)])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize(
    "cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
)
def test_avx2_decode_attention_matches_the_torch_backend(
    avx2, head_dim, num_heads, num_kv_heads, window, cache_dtype
):
    """Against the torch backend's decode on the same cache (kv_cache_dtype: fp32, bf16 or
    fp8, which both widen to fp32 as they read)."""
    from minivllm.layers.attention.torch_backend import TorchAttentionBackend, to_cache_dtype

    gen = torch.Generator().manual_seed(head_dim + window)
    block_size, num_blocks = 16, 12
    cache = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim, generator=gen)
    cache = to_cache_dtype(cache, cache_dtype)
    # 0: a row with nothing to attend to; 12 and 27: chunks of 9-15 tokens (a partial second half)
    seq_lens = torch.tensor([1, 7, 12, 16, 17, 27, 40, 0])
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:3] for _ in seq_lens])
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    out = avx2.paged_attention_decode(q, cache[0], cache[1], tables, seq_lens, scale, window)

    class Layer:
        pass

    layer = Layer()
    layer.num_heads, layer.num_kv_heads, layer.head_dim = num_heads, num_kv_heads, head_dim
    layer.scale, layer.sliding_window = scale, window or None
    live = seq_lens > 0
    meta = type("Meta", (), {})()
    meta.decode_token_indices = torch.arange(int(live.sum()))
    meta.decode_block_tables, meta.decode_seq_lens = tables[live], seq_lens[live]
    ref = torch.zeros(int(live.sum()), num_heads, head_dim)
    TorchAttentionBackend(1).decode(layer, q[live], cache, meta, ref)
    torch.testing.assert_close(out[live], ref, atol=2e-5, rtol=1e-4)
    assert torch.equal(out[~live], torch.zeros_like(out[~live]))


@needs_avx2
def test_fp32_engine_on_bf16_weights_matches_transformers(make_checkpoint):
    """A bf16 checkpoint run in fp32: its linears become panels (half the bytes), and the
    logprobs stay within 1e-4 of transformers in fp32 on the same weights."""
    from transformers import AutoModelForCausalLM

    from minivllm import LLM, SamplingParams
    from tests.conftest import assert_logprobs_match, hf_greedy

    model_dir = make_checkpoint("Qwen3ForCausalLM", dtype=torch.bfloat16, seed=5)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=128)
    model = llm.llm_engine.executor.runner.model
    layer = model.model.layers[0].mlp.gate_up_proj
    assert layer.weight.dim() == 3 and layer.weight.dtype == torch.bfloat16, "not on panels"
    # the tied head too, and the embedding reads its rows from the head's panels
    assert model.lm_head.weight.dim() == 3
    assert model.model.embed_tokens.weight is model.lm_head.weight
    # the AVX2 family's norms and SiLU-and-mul serve the fp32 engine (they were built but
    # not registered for a while, and the plain paths ran silently)
    block = model.model.layers[0]
    assert block.input_layernorm.rms_norm_op is not None
    assert block.post_attention_layernorm.add_rms_norm_op is not None
    assert block.mlp.act_fn.op is not None
    prompts = [[5, 9, 33, 120, 7], list(range(40, 90))]
    params = SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, logprobs=0, prompt_logprobs=0
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert_logprobs_match(hf, prompts, outs, tol=1e-4)
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(model_dir, prompts, 8)


def test_the_isa_cap_turns_a_newer_cpu_into_an_avx2_one(make_checkpoint):
    """MINIVLLM_CPU_ISA=avx2: no bf16 family, a bf16 checkpoint resolves to float32 on the
    AVX2 family; a cap minivllm does not know is an error that names the valid ones."""
    model_dir = make_checkpoint("Qwen3ForCausalLM", dtype=torch.bfloat16, seed=5)
    script = f"""
import json, torch
from minivllm.config import resolve_dtype
from minivllm.kernels.isa import cpu_flags, isa_summary
from minivllm.kernels.registry import select_kernels
from transformers import AutoConfig
cfg = AutoConfig.from_pretrained({str(model_dir)!r})
print(json.dumps({{
    "avx512": any(f.startswith("avx512") or f.startswith("amx") for f in cpu_flags()),
    "dtype": str(resolve_dtype("auto", cfg, "cpu")),
    "bf16": select_kernels("cpu", torch.bfloat16).name,
    "summary": isa_summary(),
}}))
"""
    env = {**os.environ, "MINIVLLM_CPU_ISA": "avx2"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got == {**got, "avx512": False, "dtype": "torch.float32", "bf16": "torch"}
    assert "MINIVLLM_CPU_ISA=avx2" in got["summary"]
    env["MINIVLLM_CPU_ISA"] = "sse2"
    bad = subprocess.run(
        [sys.executable, "-c", "from minivllm.kernels.isa import cpu_flags; cpu_flags()"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "MINIVLLM_CPU_ISA='sse2'" in bad.stderr and "avx2" in bad.stderr


@needs_avx2
@pytest.mark.parametrize("hidden", [1, 7, 64, 1000])
def test_avx2_norms_and_silu_match_the_pytorch_path(avx2, hidden):
    """The fp32 small ops against layers/layernorm.py's and activation.py's plain paths
    (same formulas, summed in another order: 1e-5 relative)."""
    from minivllm.layers.activation import SiluAndMul
    from minivllm.layers.layernorm import RMSNorm

    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(5, 3, hidden, generator=gen)
    residual = torch.randn(5, 3, hidden, generator=gen)
    norm = RMSNorm(hidden, eps=1e-6)
    norm.weight.data.copy_(torch.randn(hidden, generator=gen))
    torch.testing.assert_close(avx2.rms_norm(x, norm.weight, 1e-6), norm(x), rtol=1e-5, atol=1e-5)
    ours_residual = residual.clone()
    ours = avx2.fused_add_rms_norm(x, ours_residual, norm.weight, 1e-6)
    ref, ref_residual = norm(x, residual.clone())
    assert torch.equal(ours_residual, ref_residual)  # x + residual, one rounding either way
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    gate_up = torch.randn(4, 2 * hidden, generator=gen) * 5
    torch.testing.assert_close(
        avx2.silu_and_mul(gate_up), SiluAndMul()(gate_up), rtol=1e-5, atol=1e-5
    )
