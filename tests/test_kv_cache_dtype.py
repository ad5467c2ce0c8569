"""`kv_cache_dtype`: a paged KV cache in bf16 or fp8 under an engine computing in fp32.

The oracle for whole engines is transformers with a cache that rounds each key and value
as ours stores them (`_RoundingCache`): both then score the same rounded numbers, so our
logprobs must sit far closer to it than to plain transformers. The AVX2 kernels' write and
read are checked value by value against torch's own conversions; their decode attention
against the torch backend's in tests/test_avx2_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.layers.attention.torch_backend import to_cache_dtype
from tests.conftest import needs_avx2

KV_DTYPES = {
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def _rounding_cache(dtype: torch.dtype):
    from transformers.cache_utils import DynamicCache

    class RoundingCache(DynamicCache):
        """transformers' cache, storing each new key and value as a `dtype` cache would."""

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            key_states = to_cache_dtype(key_states, dtype).to(key_states.dtype)
            value_states = to_cache_dtype(value_states, dtype).to(value_states.dtype)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return RoundingCache()


def _hf_logprobs(hf, ids: list[int], dtype: torch.dtype | None) -> torch.Tensor:
    with torch.no_grad():
        if dtype is None:
            logits = hf(torch.tensor([ids])).logits
        else:
            cache = _rounding_cache(dtype)
            logits = hf(torch.tensor([ids]), cache=cache, use_cache=True).logits
    return logits[0].log_softmax(-1)


def _engine_logprobs(out) -> tuple[list[int], list[float]]:
    """The full sequence and our logprob of each token after the first."""
    completion = out.outputs[0]
    full = list(out.prompt_token_ids) + list(completion.token_ids)
    n = len(out.prompt_token_ids)
    ours = [out.prompt_logprobs[p][full[p]].logprob for p in range(1, n)]
    ours += [completion.logprobs[i][t].logprob for i, t in enumerate(completion.token_ids)]
    return full, ours


@pytest.mark.parametrize("kv", list(KV_DTYPES))
@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_engine_matches_transformers_with_a_rounding_cache(make_checkpoint, kv, cpu_kernels):
    """An fp32 engine with a bf16 / fp8 cache against transformers storing the same
    rounded keys and values: prompts in chunks of 8 tokens (later chunks read the earlier
    ones back from the cache) and greedy decodes, on the kernels and the torch path.

    The bound: both sides round fp32 keys that differ by ~1e-6, so a value on a rounding
    boundary can land one step apart; the cache's own rounding moves the logprobs far more
    (checked: plain transformers is at least 10x further away on average)."""
    from transformers import AutoModelForCausalLM

    model = make_checkpoint("Qwen3ForCausalLM")
    llm = LLM(
        str(model),
        dtype="float32",
        kv_cache_dtype=kv,
        kv_cache_memory_bytes=4 << 20,
        max_model_len=128,
        block_size=4,
        max_num_batched_tokens=8,
        cpu_kernels=cpu_kernels,
    )
    runner = llm.llm_engine.executor.runner
    assert all(spec.dtype == KV_DTYPES[kv] for spec in runner.kv_cache_specs)
    assert all(layer.kv_cache.dtype == KV_DTYPES[kv] for layer in runner.attention_layers)
    outs = scored_generations(llm)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    assert_closer_to_oracle(
        outs,
        lambda ids: _hf_logprobs(hf, ids, KV_DTYPES[kv]),
        lambda ids: _hf_logprobs(hf, ids, None),
    )


def scored_generations(llm: LLM) -> list:
    """Three prompts (3, 13 and 21 tokens) with their prompt logprobs and 12 greedy tokens."""
    prompts = [list(range(5, 5 + n)) for n in (3, 13, 21)]
    params = SamplingParams(
        temperature=0, max_tokens=12, logprobs=1, prompt_logprobs=1, ignore_eos=True
    )
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def assert_closer_to_oracle(outs, oracle, other, bound: float = 5e-4) -> None:
    """Our logprob of every token of `outs` (prompt and completion) lies within `bound` of
    `oracle`'s (token ids -> [T, vocab] logprobs), and `other` (the same model without the
    cache's rounding) is on average at least 10x further away."""
    to_oracle, to_other = [], []
    for out in outs:
        full, ours = _engine_logprobs(out)
        want, far = oracle(full), other(full)
        for pos in range(1, len(full)):
            to_oracle.append(abs(ours[pos - 1] - want[pos - 1, full[pos]].item()))
            to_other.append(abs(ours[pos - 1] - far[pos - 1, full[pos]].item()))
    mean_oracle = sum(to_oracle) / len(to_oracle)
    mean_other = sum(to_other) / len(to_other)
    assert mean_other > 10 * mean_oracle, (mean_oracle, mean_other)
    assert max(to_oracle) < bound, max(to_oracle)


@needs_avx2
@pytest.mark.parametrize("dtype", list(KV_DTYPES.values()))
def test_avx2_write_rounds_as_torch(avx2, dtype):
    """The AVX2 cache write stores what `to_cache_dtype` (torch's rounding, fp8 saturated)
    stores, bit for bit: random values, fp8's overflow, ties and subnormals among them."""
    gen = torch.Generator().manual_seed(1)
    num_kv, dim, num_blocks, block_size = 2, 16, 5, 4
    k = torch.randn(6, num_kv, dim, generator=gen) * 4
    v = torch.randn(6, num_kv, dim, generator=gen)
    k[0, 0, :6] = torch.tensor([1e4, -1e6, 3e-3, -1e-5, 448.0, 1.0 + 2**-8])
    slots = torch.tensor([3, 0, 17, 9, 19, 11])
    cache = torch.zeros(2, num_kv, num_blocks, block_size, dim, dtype=dtype)
    avx2.write_kv_cache(cache, k, v, slots)
    flat = cache.view(torch.uint8 if dtype.itemsize == 1 else torch.int16)
    flat = flat.view(2, num_kv, -1, dim)
    for i, x in enumerate((k, v)):
        expected = to_cache_dtype(x, dtype).transpose(0, 1)
        expected = expected.contiguous().view(flat.dtype)
        assert torch.equal(flat[i][:, slots], expected)


@needs_avx2
@pytest.mark.parametrize("dtype", list(KV_DTYPES.values()))
@pytest.mark.parametrize("group", [1, 2])
def test_avx2_decode_reads_every_value_exactly(avx2, dtype, group):
    """With one token of context attention returns that token's value: every finite fp8
    byte (subnormals included), or bf16 bit patterns across the whole range, widened
    exactly as torch widens them; read in place (one query head per KV head) or widened
    once per chunk (two). fp8 runs with the caller flushing denormals (MXCSR's DAZ/FTZ,
    torch.set_flush_denormal): its subnormal codes pass through fp32 subnormals, which
    the kernel must keep."""
    dim = 8
    if dtype.itemsize == 1:
        bits = torch.arange(256, dtype=torch.uint8)
        bits = bits[torch.isfinite(bits.view(dtype).float())]
    else:
        gen = torch.Generator().manual_seed(2)
        bits = torch.randint(-(2**15), 2**15, (512,), generator=gen, dtype=torch.int16)
        bits[:8] = torch.tensor([1, 2, 0x7F, -32767, 0, -(2**15), 0x0080, 0x7F7F])  # subnormals...
        bits = bits[torch.isfinite(bits.view(torch.bfloat16).float())]
    bits = bits[: len(bits) // dim * dim]
    rows = len(bits) // dim
    cache = torch.zeros(2, 1, rows, 1, dim, dtype=dtype)
    cache.view(bits.dtype)[1] = bits.view(1, rows, 1, dim)
    tables = torch.arange(rows).unsqueeze(1)
    q = torch.zeros(rows, group, dim)
    flush = dtype.itemsize == 1 and torch.set_flush_denormal(True)
    try:
        out = avx2.paged_attention_decode(
            q, cache[0], cache[1], tables, torch.ones(rows, dtype=torch.long), 1.0, 0
        )
    finally:
        torch.set_flush_denormal(False)
    expected = cache[1].view(rows, 1, dim).float().expand(rows, group, dim)
    assert torch.equal(out, expected), flush


@needs_avx2
@pytest.mark.parametrize("kv", ["bfloat16", "fp8"])
def test_avx2_decode_step_with_a_narrow_cache_equals_the_per_layer_path(make_checkpoint, kv):
    """The one-call decode step writes and reads a bf16 / fp8 cache as the per-layer path
    does: equal tokens and logprobs, bit for bit."""
    from minivllm.layers.fused_decode import Avx2FusedDecode
    from tests.test_avx2_decode import _greedy

    llm = LLM(
        str(make_checkpoint("Qwen3ForCausalLM")),
        dtype="float32",
        kv_cache_dtype=kv,
        kv_cache_memory_bytes=4 << 20,
        max_model_len=64,
        block_size=4,
        enable_prefix_caching=False,
        quantization="online",
        quantization_config={"targets": {"*": {"scheme": "int4_w4a8", "group_size": 64}}},
    )
    fused = llm.llm_engine.executor.runner.fused_decode
    assert isinstance(fused, Avx2FusedDecode)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 9, 1, 7, 13)]
    assert _greedy(llm, prompts, fused) == _greedy(llm, prompts, None)


def test_a_narrow_cache_holds_more_tokens(make_checkpoint):
    """The same memory budget buys twice the blocks in bf16 and four times in fp8 as in
    an fp32 engine's own cache."""
    model = str(make_checkpoint("Qwen3ForCausalLM"))
    blocks = {}
    for kv in ("auto", "bfloat16", "fp8_e4m3"):
        llm = LLM(
            model,
            dtype="float32",
            kv_cache_dtype=kv,
            kv_cache_memory_bytes=2 << 20,
            max_model_len=64,
            block_size=4,
        )
        blocks[kv] = llm.llm_engine.kv_cache_manager.pool.num_blocks
        del llm
    assert blocks["bfloat16"] == 2 * blocks["auto"]
    assert blocks["fp8_e4m3"] == 4 * blocks["auto"]


def test_kv_cache_dtype_errors(make_checkpoint):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(str(make_checkpoint("Qwen3ForCausalLM")), kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="under a float16 engine saves no memory"):
        LLM(str(make_checkpoint("Qwen3ForCausalLM")), dtype="float16", kv_cache_dtype="bfloat16")
    with pytest.raises(ValueError, match="latent \\(MLA\\) cache"):
        LLM("demo-sparse", dtype="float32", kv_cache_dtype="fp8", max_model_len=64)


def test_serve_takes_kv_cache_dtype(capsys):
    from minivllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "demo-base", "--kv-cache-dtype", "bfloat16"])
    assert args.kv_cache_dtype == "bfloat16"
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "demo-base", "--kv-cache-dtype", "int8"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'int8'" in capsys.readouterr().err


def test_a_draft_model_shares_the_narrow_cache(make_checkpoint):
    """Speculative decoding with a draft model: the draft's layers take blocks of the same
    bf16 pool, and greedy outputs equal plain decoding's with that cache."""
    model = str(make_checkpoint("Qwen3ForCausalLM"))
    options = dict(
        dtype="float32",
        kv_cache_dtype="bfloat16",
        kv_cache_memory_bytes=4 << 20,
        max_model_len=128,
    )
    prompts = [{"prompt_token_ids": [5 + (i * 7 + j) % 40 for j in range(9 + i)]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)

    def run(llm: LLM) -> list:
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

    plain = run(LLM(model, **options))
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 3}
    llm = LLM(model, speculative_config=spec, **options)
    runner = llm.llm_engine.executor.runner
    assert {layer.kv_cache.dtype for layer in runner.attention_layers} == {torch.bfloat16}
    for got, want in zip(run(llm), plain, strict=True):
        # equal tokens; the two runs batch their keys differently, so a bf16 rounding may
        # fall the other way and part them, but only at a near tie of the plain run's top two
        same = [a == b for a, b in zip(got.token_ids, want.token_ids)] + [False]
        first = same.index(False)
        if first < len(want.token_ids):
            top = sorted((lp.logprob for lp in want.logprobs[first].values()), reverse=True)
            assert top[0] - top[1] < 1e-2, (first, top)
    stats = llm.llm_engine.stats().spec_decode
    assert stats.num_accepted_tokens > 0
