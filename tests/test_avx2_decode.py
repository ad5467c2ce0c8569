"""The fp32 engine's one-call decode step on the AVX2 family (`kernels/avx2_decode.cpp`)
and the two ops it shares with the per-layer path (rotary in place, the KV-cache write).

The step runs the per-layer path's kernels in its order, so the oracle is that path
(engines with the step swapped out: equal bits); the per-layer path itself is checked
against transformers elsewhere (tests/test_avx2_kernels.py, tests/test_quantization.py),
and the two small ops here against plain PyTorch.
"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from tests.conftest import needs_avx2


@needs_avx2
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotary_inplace_matches_the_plain_path(avx2, rotary_dim):
    """q [T, heads, D] rotated in place (a strided view into a fused qkv row, as the layer
    passes it) against layers/rotary.py's out-of-place path; a partial rotary leaves the
    rest of each head alone."""
    from minivllm.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(
        64, {"rope_theta": 10000.0, "partial_rotary_factor": rotary_dim / 64}, 128, 128
    )
    gen = torch.Generator().manual_seed(rotary_dim)
    qkv = torch.randn(5, 6 * 64, generator=gen)
    q = qkv[:, : 4 * 64].view(5, 4, 64)
    positions = torch.tensor([0, 3, 17, 127, 64])
    expected = rope.rotate(positions, q.clone())
    avx2.rotary_inplace(q, positions, rope.cos_cache, rope.sin_cache)
    assert torch.allclose(q, expected, rtol=0, atol=1e-6)
    assert torch.equal(qkv[:, 4 * 64 :], qkv[:, 4 * 64 :].clone())  # untouched
    with pytest.raises(RuntimeError, match="position"):
        avx2.rotary_inplace(q, torch.tensor([0, 1, 2, 3, 128]), rope.cos_cache, rope.sin_cache)


@needs_avx2
def test_write_kv_cache_equals_index_copy(avx2):
    gen = torch.Generator().manual_seed(0)
    num_kv, dim, num_blocks, block_size = 2, 16, 6, 4
    qkv = torch.randn(5, (4 + 2 * num_kv) * dim, generator=gen)
    k = qkv[:, 4 * dim : (4 + num_kv) * dim].view(5, num_kv, dim)
    v = qkv[:, (4 + num_kv) * dim :].view(5, num_kv, dim)
    slots = torch.tensor([3, 0, 17, 9, 23])
    cache = torch.zeros(2, num_kv, num_blocks, block_size, dim)
    avx2.write_kv_cache(cache, k, v, slots)
    expected = torch.zeros(2, num_kv, num_blocks * block_size, dim)
    expected[0].index_copy_(1, slots, k.transpose(0, 1))
    expected[1].index_copy_(1, slots, v.transpose(0, 1))
    assert torch.equal(cache.view(2, num_kv, -1, dim), expected)
    with pytest.raises(RuntimeError, match="slot"):
        avx2.write_kv_cache(cache, k, v, torch.tensor([3, 0, 17, 9, 24]))


def _greedy(llm: LLM, prompts, fused) -> list:
    runner = llm.llm_engine.executor.runner
    runner.fused_decode = fused
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [
        (
            o.outputs[0].token_ids,
            [{t: p.logprob for t, p in d.items()} for d in o.outputs[0].logprobs],
        )
        for o in outs
    ]


@needs_avx2
@pytest.mark.parametrize(
    "arch,overrides,quantization",
    [
        ("Qwen3ForCausalLM", {"dtype": torch.bfloat16}, None),  # q/k RMSNorm, bf16 panels
        ("Qwen3ForCausalLM", {}, None),  # an fp32 checkpoint: at::linear
        ("Qwen2ForCausalLM", {"hidden_size": 128}, None),  # QKV bias
        ("MistralForCausalLM", {"hidden_size": 128, "sliding_window": 6}, None),
        ("Qwen3ForCausalLM", {}, {"targets": {"*": {"scheme": "int8_w8a16"}}}),
        (
            "Qwen3ForCausalLM",
            {},
            {"targets": {"*": {"scheme": "int4_w4a16", "group_size": 32, "symmetric": False}}},
        ),
        ("Qwen2ForCausalLM", {"hidden_size": 128}, {"targets": {"*": {"scheme": "fp8_w8a16"}}}),
        ("Qwen3ForCausalLM", {}, {"targets": {"*": {"scheme": "int4_w4a8", "group_size": 64}}}),
    ],
)
def test_avx2_decode_step_equals_the_per_layer_path(make_checkpoint, arch, overrides, quantization):
    """The one-call step and the per-layer path on the same engine: equal tokens and equal
    logprobs, bit for bit, for 12 requests of different lengths (1 to 9 rows a step, both
    of the quantized op's forms) over blocks of 4 tokens."""
    from minivllm.layers.fused_decode import Avx2FusedDecode

    options = (
        {}
        if quantization is None
        else {"quantization": "online", "quantization_config": quantization}
    )
    llm = LLM(
        str(make_checkpoint(arch, **overrides)),
        dtype="float32",
        kv_cache_memory_bytes=4 << 20,
        max_model_len=64,
        block_size=4,
        enable_prefix_caching=False,  # the second run must not start from the first one's blocks
        **options,
    )
    fused = llm.llm_engine.executor.runner.fused_decode
    assert isinstance(fused, Avx2FusedDecode)
    scheme = None if quantization is None else quantization["targets"]["*"]["scheme"]
    # unquantized: a bf16 checkpoint's panels, or an fp32 one's weights on at::linear
    unquantized = 0 if overrides.get("dtype") == torch.bfloat16 else -1
    kinds = {None: unquantized, "int8_w8a16": 1, "int4_w4a16": 2, "fp8_w8a16": 3, "int4_w4a8": 5}
    kind = kinds[scheme]
    assert set(fused.linears[0::3]) == {kind}  # every linear of every layer
    prompts = [
        {"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 9, 1, 2, 5, 7, 4, 6, 8, 11, 13, 2)
    ]
    assert _greedy(llm, prompts, fused) == _greedy(llm, prompts, None)


@needs_avx2
def test_int8_w8a8_in_fp32_keeps_the_per_layer_path(make_checkpoint):
    """int8_w8a8 in an fp32 engine quantizes its activations in Python first: no fused step,
    and the start-up says why."""
    llm = LLM(
        str(make_checkpoint("Qwen3ForCausalLM")),
        dtype="float32",
        quantization="int8_w8a8",
        kv_cache_memory_bytes=4 << 20,
        max_model_len=64,
    )
    runner = llm.llm_engine.executor.runner
    assert runner.fused_decode is None
    from minivllm.layers.fused_decode import why_not_fused

    reason = why_not_fused(runner.model.decoder_stack_parts(), runner.attn_backend, fp32=True)
    assert reason == "int8_w8a8 has no fused fp32 step"
