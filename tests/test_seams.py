"""The seams features plug into: attention backends and KV cache specs, the kernel registry,
the linear-method interface, the persistent input batch, and what the engine logs it chose."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from minivllm import LLM, SamplingParams
from minivllm.kernels import cpu_has_avx512_bf16
from minivllm.kernels.isa import cpu_flags
from minivllm.kernels.registry import TORCH, select_kernels
from minivllm.layers.attention import (
    Attention,
    AttentionBackend,
    CommonAttentionMetadata,
    FullAttentionSpec,
    KVCacheSpec,
)
from minivllm.layers.attention.registry import register_attention_backend, select_attention_backend
from minivllm.layers.attention.torch_backend import TorchAttentionBackend
from minivllm.layers.linear import ColumnParallelLinear
from minivllm.layers.linear_method import LinearMethodBase
from minivllm.worker.input_batch import InputBatch, build_sampling_metadata
from minivllm.worker.request_state import CachedRequestState

needs_kernel = pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="CPU lacks AVX512-BF16")


# --- a test-only attention backend: its own (token-major) cache layout, its own metadata ---


@dataclass
class ToyMetadata:
    slots: torch.Tensor  # [num_tokens]
    # per request: its query rows and the cache slots of its whole sequence
    requests: list[tuple[int, int, torch.Tensor]]


class TokenMajorBackend(AttentionBackend):
    """Cache `[num_blocks * block_size, 2, Hkv, D]`: a token's keys and values side by side.
    Attention is the textbook formula, one request at a time."""

    name = "toy-token-major"

    def kv_cache_shape(self, spec: KVCacheSpec, num_blocks: int) -> tuple[int, ...]:
        assert isinstance(spec, FullAttentionSpec)
        return (num_blocks * spec.block_size, 2, spec.num_kv_heads, spec.head_size)

    def build_metadata(self, common: CommonAttentionMetadata) -> ToyMetadata:
        requests = []
        for i in range(common.num_reqs):
            blocks = common.block_table[i, : common.num_blocks[i]]
            offsets = torch.arange(common.block_size)
            slots = (blocks.unsqueeze(1) * common.block_size + offsets).flatten()
            start, end = common.query_start_loc[i], common.query_start_loc[i + 1]
            requests.append((start, end, slots[: common.seq_lens[i]]))
        return ToyMetadata(common.slot_mapping, requests)

    def forward(self, layer, q, k, v, kv_cache, metadata: ToyMetadata) -> torch.Tensor:
        kv_cache[metadata.slots, 0] = k
        kv_cache[metadata.slots, 1] = v
        out = torch.empty_like(q)
        group = layer.num_heads // layer.num_kv_heads
        for start, end, slots in metadata.requests:
            keys = kv_cache[slots, 0].repeat_interleave(group, dim=1)  # [S, H, D]
            values = kv_cache[slots, 1].repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,shd->hqs", q[start:end].float(), keys.float()) * layer.scale
            q_pos = torch.arange(len(slots) - (end - start), len(slots)).unsqueeze(1)
            visible = torch.arange(len(slots)).unsqueeze(0) <= q_pos
            if layer.sliding_window is not None:
                visible &= torch.arange(len(slots)).unsqueeze(0) > q_pos - layer.sliding_window
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            out[start:end] = torch.einsum("hqs,shd->qhd", probs, values.float()).to(q.dtype)
        return out


register_attention_backend("toy-token-major", lambda kernels, n: TokenMajorBackend(n))


def _generate(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        (
            o.outputs[0].token_ids,
            [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
        )
        for o in outs
    ]


def test_a_backend_with_its_own_cache_layout_plugs_in_by_name(qwen3_dir):
    """One registry line: the engine sizes, allocates and runs the toy backend's cache."""
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41], list(range(60, 90))]
    results = {}
    for name in ("torch", "toy-token-major"):
        llm = LLM(
            str(qwen3_dir),
            dtype="float32",
            kv_cache_memory_bytes=4 << 20,
            max_model_len=64,
            block_size=4,
            max_num_batched_tokens=16,  # chunked prefill: context reads from the cache
            attention_backend=name,
        )
        runner = llm.llm_engine.executor.runner
        assert runner.attn_backend.name == name
        layer = runner.attention_layers[0]
        num_blocks = llm.llm_engine.kv_cache_manager.pool.num_blocks
        heads, dim = layer.num_kv_heads, layer.head_dim
        expected = {
            "torch": (2, heads, num_blocks, 4, dim),
            "toy-token-major": (num_blocks * 4, 2, heads, dim),
        }
        assert tuple(layer.kv_cache.shape) == expected[name]
        results[name] = _generate(llm, prompts)
    for (tokens, lps), (toy_tokens, toy_lps) in zip(results["torch"], results["toy-token-major"]):
        assert tokens == toy_tokens
        assert lps == pytest.approx(toy_lps, abs=1e-4)


def test_an_unknown_attention_backend_is_refused_with_the_names(qwen3_dir):
    with pytest.raises(ValueError, match="unknown attention backend 'nope'.*torch"):
        select_attention_backend("nope", TORCH)


def test_kv_cache_bytes_come_from_the_layers_specs(qwen3_llm):
    runner = qwen3_llm.llm_engine.executor.runner
    spec = runner.kv_cache_specs[0]
    assert isinstance(spec, FullAttentionSpec)
    layer = runner.attention_layers[0]
    assert spec.page_size_bytes == 2 * spec.block_size * layer.num_kv_heads * layer.head_dim * 4
    assert runner.kv_cache_bytes_per_block() == spec.page_size_bytes * len(runner.attention_layers)
    assert len(runner.kv_cache_specs) == len(runner.attention_layers) == 2


# --- multi-token decode: the batched decode path against the per-request prefill path ---


def _mixed_step(backend: TorchAttentionBackend, dtype: torch.dtype, seed: int = 0):
    """One step of 5 requests with query lengths 1, 3, 4, 6, 2 over cached context."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv, dim, block_size, num_blocks = 4, 2, 64, 4, 40
    layer = Attention(num_heads, dim, num_kv, dim**-0.5, sliding_window=None)
    spec = layer.get_kv_cache_spec(block_size, dtype)
    cache = torch.randn(backend.kv_cache_shape(spec, num_blocks), generator=gen).to(dtype)
    query_lens, context_lens = [1, 3, 4, 6, 2], [9, 0, 5, 13, 7]
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots, cu = [], [], [0]
    for q_len, ctx in zip(query_lens, context_lens):
        n = -(-(q_len + ctx) // block_size)
        blocks, free = free[:n], free[n:]
        tables.append(blocks + [0] * (8 - n))
        slots += [
            blocks[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + q_len)
        ]
        cu.append(cu[-1] + q_len)
    common = CommonAttentionMetadata(
        query_start_loc=cu,
        seq_lens=[q + c for q, c in zip(query_lens, context_lens)],
        num_blocks=[-(-(q + c) // block_size) for q, c in zip(query_lens, context_lens)],
        block_table=torch.tensor(tables),
        slot_mapping=torch.tensor(slots),
        block_size=block_size,
    )
    t = cu[-1]
    q = torch.randn(t, num_heads, dim, generator=gen).to(dtype)
    k = torch.randn(t, num_kv, dim, generator=gen).to(dtype)
    v = torch.randn(t, num_kv, dim, generator=gen).to(dtype)
    return layer, common, cache, q, k, v


@pytest.mark.parametrize("window", [None, 3])
def test_several_query_tokens_per_request_decode_as_one_batch(window):
    results = []
    for decode_query_len in (1, 4):
        backend = TorchAttentionBackend(decode_query_len)
        layer, common, cache, q, k, v = _mixed_step(backend, torch.float32)
        layer.sliding_window = window
        meta = backend.build_metadata(common)
        expected_prefills = [3] if decode_query_len == 4 else [1, 2, 3, 4]
        assert meta.prefill_req_indices == expected_prefills
        assert meta.num_decode_tokens == (1 + 3 + 4 + 2 if decode_query_len == 4 else 1)
        results.append(backend.forward(layer, q, k, v, cache, meta))
    torch.testing.assert_close(results[1], results[0], atol=1e-5, rtol=1e-5)


@needs_kernel
def test_the_cpu_backend_decodes_several_query_tokens_like_the_torch_backend():
    kernels = select_kernels("cpu", torch.bfloat16)
    reference = TorchAttentionBackend(1)
    cpu = select_attention_backend("cpu", kernels, decode_query_len=4)
    outs = []
    for backend in (reference, cpu):
        layer, common, cache, q, k, v = _mixed_step(backend, torch.bfloat16, seed=3)
        outs.append(backend.forward(layer, q, k, v, cache, backend.build_metadata(common)))
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=3e-2, rtol=3e-2)


# --- the kernel registry and the linear-method interface ---


def test_kernels_are_chosen_by_device_dtype_and_isa():
    fp32 = select_kernels("cpu", torch.float32)
    if {"avx2", "fma", "f16c"} <= cpu_flags():
        assert fp32.name == "cpu-avx2"
        assert fp32.op("linear_bf16w") is not None and fp32.op("rms_norm") is not None
        assert fp32.op("argmax_bf16") is None  # a bf16-family op only
        assert fp32.op("llama_decode_layers") is None  # the bf16 step's signature
        assert fp32.op("avx2_decode_layers") is not None
    else:
        assert fp32 is TORCH
    assert select_kernels("cpu", torch.float16) is TORCH
    assert select_kernels("cpu", torch.bfloat16, enabled=False) is TORCH
    assert TORCH.op("rms_norm") is None
    kernels = select_kernels("cpu", torch.bfloat16)
    if cpu_has_avx512_bf16():
        assert kernels.name == "cpu-avx512_bf16"
        assert kernels.op("rms_norm") is not None and kernels.op("no_such_op") is None
    else:
        assert kernels is TORCH


def test_kernel_builds_follow_the_users_cache_directory(monkeypatch, tmp_path):
    from minivllm.kernels import kernel_build_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernel_build_dir() == str(tmp_path / "minivllm" / "kernels")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kernel_build_dir() == str(tmp_path / "home" / ".cache" / "minivllm" / "kernels")


class RowScaledInt8Method(LinearMethodBase):
    """A test-only scheme: bf16/fp32 weights in, int8 rows with one scale each after loading."""

    def create_weights(self, layer, input_size, output_size, weight_loader) -> None:
        weight = torch.nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        weight.weight_loader = weight_loader
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer, kernels) -> None:
        scale = layer.weight.abs().amax(dim=1, keepdim=True) / 127
        layer.qweight = torch.round(layer.weight / scale).to(torch.int8)
        layer.scale = scale
        del layer.weight

    def apply(self, layer, x, bias):
        return F.linear(x, layer.qweight.to(x.dtype) * layer.scale, bias)


def test_a_linear_method_owns_creation_processing_and_math():
    gen = torch.Generator().manual_seed(0)
    layer = ColumnParallelLinear(32, 16, bias=True, quant_method=RowScaledInt8Method())
    w, b = torch.randn(16, 32, generator=gen), torch.randn(16, generator=gen)
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, b)
    layer.quant_method.process_weights_after_loading(layer, TORCH)
    assert layer.qweight.dtype == torch.int8 and not hasattr(layer, "weight")
    x = torch.randn(3, 32, generator=gen)
    # per-row int8: within half a step of each row's scale, summed over the inputs
    err_bound = (x.abs() @ (w.abs().amax(dim=1) / 254).expand(32, 16)) + 1e-5
    assert ((layer(x) - F.linear(x, w, b)).abs() <= err_bound).all()


# --- the persistent input batch against a fresh rebuild every step ---


def _state(req_id: str, params: SamplingParams, prompt: list[int], output: list[int]):
    gen = None if params.seed is None else torch.Generator().manual_seed(params.seed)
    return CachedRequestState(
        req_id, prompt + output, len(prompt), params, [], 0, frozenset({1}), gen
    )


def _equal_metadata(a, b) -> None:
    for name in (
        "temperature",
        "is_greedy",
        "top_k",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "output_token_counts",
        "prompt_token_mask",
        "seen_token_mask",
        "logit_bias",
    ):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert torch.equal(x, y), name
    assert a.all_greedy == b.all_greedy
    assert a.banned_token_ids == b.banned_token_ids
    assert list(a.generators) == list(b.generators)


def test_the_input_batch_stays_equal_to_a_fresh_rebuild():
    rng = random.Random(0)
    vocab = 50
    kinds = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.2),
        SamplingParams(temperature=1.0, top_p=0.9, frequency_penalty=0.5, presence_penalty=0.1),
        SamplingParams(temperature=1.0, min_p=0.1, seed=7, logit_bias={3: 2.0}, min_tokens=4),
    ]
    batch = InputBatch(2, vocab, "cpu")  # grows past 2
    live: dict[str, CachedRequestState] = {}
    for step in range(40):
        if rng.random() < 0.3 and live:  # some requests leave
            gone = set(rng.sample(sorted(live), k=rng.randint(1, len(live))))
            batch.remove(gone)
            for r in gone:
                del live[r]
        if rng.random() < 0.5 or not live:  # a request arrives (some with outputs: a resume)
            req_id = f"r{step}"
            prompt = [rng.randrange(2, vocab) for _ in range(rng.randint(1, 6))]
            output = [rng.randrange(2, vocab) for _ in range(rng.randint(0, 3))]
            live[req_id] = _state(req_id, rng.choice(kinds), prompt, output)
            batch.add(live[req_id])
        sampling = [r for r in live if rng.random() < 0.8] or sorted(live)[:1]
        got = batch.sampling_metadata(sampling)
        _equal_metadata(got, build_sampling_metadata([live[r] for r in sampling], vocab, "cpu"))
        tokens = [rng.randrange(vocab) for _ in sampling]
        for r, t in zip(sampling, tokens):
            live[r].token_ids.append(t)
        batch.record_sampled(sampling, tokens)


def test_steady_decode_rows_are_views_not_copies():
    batch = InputBatch(8, 20, "cpu")
    params = SamplingParams(temperature=1.0, repetition_penalty=1.1)
    for i in range(3):
        batch.add(_state(str(i), params, [2, 3], []))
    meta = batch.sampling_metadata(["0", "1", "2"])
    assert meta.output_token_counts.data_ptr() == batch.output_token_counts.data_ptr()
    batch.remove({"1"})
    assert batch.sampling_metadata(["0", "2"]).prompt_token_mask.shape == (2, 20)


# --- enforce_eager and what the engine says it chose ---


@needs_kernel
def test_enforce_eager_turns_the_fused_step_off_with_equal_outputs(qwen3_dir, caplog):
    import logging

    outputs = []
    for eager in (False, True):
        with caplog.at_level(logging.INFO, logger="minivllm"):
            llm = LLM(
                str(qwen3_dir),
                dtype="bfloat16",
                kv_cache_memory_bytes=4 << 20,
                max_model_len=64,
                enforce_eager=eager,
            )
        runner = llm.llm_engine.executor.runner
        assert (runner.fused_decode is None) == eager
        outputs.append(_generate(llm, [[5, 6, 7], [9, 8, 7, 6, 5]]))
    assert "all-layers decode step: off: enforce_eager" in caplog.text
    assert "attention backend: cpu" in caplog.text and "avx512_bf16" in caplog.text
    assert outputs[0] == outputs[1]


def test_a_model_that_does_not_describe_its_layers_gets_no_fused_step():
    from minivllm.layers.fused_decode import FusedLlamaDecode

    kernels = select_kernels("cpu", torch.bfloat16)
    backend = select_attention_backend(None, kernels)
    fused, reason = FusedLlamaDecode.build(torch.nn.Linear(2, 2), kernels, backend)
    assert fused is None
    assert "does not describe its decoder layers" in reason or "no fused decode step" in reason


@needs_kernel
def test_engines_in_one_process_keep_their_own_kernel_choices(qwen3_dir):
    """Layers are never shared between models (a shared rotary once carried one engine's
    kernels into the next)."""

    def rotary(llm: LLM):
        return llm.llm_engine.executor.runner.model.model.layers[0].self_attn.rotary_emb

    args = dict(dtype="bfloat16", kv_cache_memory_bytes=4 << 20, max_model_len=64)
    with_kernels = LLM(str(qwen3_dir), **args)
    without = LLM(str(qwen3_dir), cpu_kernels=False, **args)
    assert rotary(with_kernels).uses_kernels and not rotary(without).uses_kernels
    assert rotary(with_kernels) is not rotary(without)
