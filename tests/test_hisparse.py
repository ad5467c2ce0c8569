"""HiSparse: a host KV tier under sparse-MLA decode, bit-identical to the all-resident run.

The oracle is the same engine with a device budget large enough that nothing spills: the
tier may change where a row lives, never a value or an operation, so tokens and
logprobs must be equal exactly, not within a tolerance.
"""

from __future__ import annotations

import glob
import json
import os
import re
from pathlib import Path

import pytest

from minivllm import LLM, SamplingParams
from minivllm.hisparse.host_pool import HostKVPool
from minivllm.metrics import EngineMetrics
from tests.test_deepseek_v32 import _prompts, build_dsa_checkpoint

BLOCK = 16
# 3 layers x 16 tokens x (latent 40 + index key 16) float32 values
BLOCK_BYTES = 3 * BLOCK * (40 + 16) * 4
BASE = dict(dtype="float32", block_size=BLOCK, max_num_batched_tokens=64)
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)


def connector(gib: float = 0.01, **extra) -> dict:
    return {
        "kv_connector": "HiSparseConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"host_pool_gib": gib, **extra},
    }


@pytest.fixture(scope="module")
def dsa_long(tmp_path_factory, tokenizer_dir) -> Path:
    return build_dsa_checkpoint(
        tmp_path_factory.mktemp("dsa-long"), tokenizer_dir, max_position_embeddings=4096
    )


def _run(path: Path, prompts, params=PARAMS, **kwargs):
    llm = LLM(str(path), **{**BASE, "max_model_len": 1024, **kwargs})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, outs


def _assert_identical(got, want, tol: float = 0.0) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for g_pos, w_pos in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
            assert g_pos.keys() == w_pos.keys()
            for t, lp in w_pos.items():
                assert abs(g_pos[t].logprob - lp.logprob) <= tol


@pytest.fixture(scope="module")
def resident(dsa_long):
    """The oracle: four long requests at once, every page resident (no spill possible)."""
    prompts = _prompts([300, 520, 200, 700], seed=1)
    llm, outs = _run(dsa_long, prompts, kv_cache_memory_bytes=400 * BLOCK_BYTES)
    assert llm.llm_engine.stats().num_preemptions == 0
    return prompts, outs


@pytest.mark.parametrize(
    "variant",
    ["ram", "mmap", "no-eager-mirror", "small-hot-buffer"],
)
def test_outputs_identical_with_host_tier(dsa_long, resident, tmp_path, variant) -> None:
    """24 device blocks (384 tokens) for four requests of 200-700 tokens: pages spill,
    decodes read them through hot buffers; every token and logprob equals the oracle's."""
    prompts, want = resident
    extra, tuning = {}, None
    if variant == "mmap":
        extra["host_pool_file"] = str(tmp_path / "pool.bin")
    if variant == "no-eager-mirror":
        tuning = {"hisparse_config": {"eager_host_mirror": False}}
    if variant == "small-hot-buffer":  # the least a step needs: evictions every step
        tuning = {"hisparse_config": {"device_buffer_size": 16}}
    llm, got = _run(
        dsa_long,
        prompts,
        kv_cache_memory_bytes=24 * BLOCK_BYTES,
        kv_transfer_config=connector(**extra),
        attention_config=tuning,
    )
    _assert_identical(got, want)
    stats = llm.llm_engine.stats()
    hs = stats.hisparse
    assert stats.num_preemptions == 0
    assert hs.spills > 0 and hs.misses > 0 and hs.lookups > 0
    assert hs.hits + hs.misses == hs.lookups
    assert hs.host_to_device_bytes >= hs.misses * 40 * 4  # a latent row is 40 floats
    if variant == "mmap":
        assert not os.path.exists(tmp_path / "pool.bin")  # unlinked once mapped
    if variant == "small-hot-buffer":
        assert hs.hits < hs.misses  # 16 rows for a 16-token selection: mostly refills


def test_shared_index_layers_identical_with_host_tier(tmp_path_factory, tokenizer_dir) -> None:
    """GLM-MoE-DSA: two of four layers keep no indexer keys (they reuse the layer before
    them's selection), so the host pool's layers have different widths; spilled pages
    still read back to the resident run's tokens and logprobs."""
    from tests.test_deepseek_v32 import GLM

    path = build_dsa_checkpoint(
        tmp_path_factory.mktemp("glm-long"),
        tokenizer_dir,
        glm=True,
        max_position_embeddings=4096,
        **GLM,
    )
    block_bytes = BLOCK * (4 * 40 + 2 * 16) * 4
    prompts = _prompts([300, 520, 200, 700], seed=1)
    _, want = _run(path, prompts, kv_cache_memory_bytes=400 * block_bytes)
    llm, got = _run(
        path, prompts, kv_cache_memory_bytes=24 * block_bytes, kv_transfer_config=connector()
    )
    _assert_identical(got, want)
    hs = llm.llm_engine.stats().hisparse
    assert hs.spills > 0 and hs.misses > 0 and hs.hits + hs.misses == hs.lookups


def test_layers_packed_in_one_allocation_bind_their_own_rows(
    dsa_long, resident, monkeypatch
) -> None:
    """vLLM #57019: layers packed in one host allocation were all bound at its base, so
    later layers overwrote earlier ones. Binding every layer at layer 0's rows here must
    change outputs (the identity test above would catch that bug), and does not crash."""
    prompts, want = resident
    real_latent, real_index = HostKVPool.latent, HostKVPool.index
    monkeypatch.setattr(HostKVPool, "latent", lambda self, layer: real_latent(self, 0))
    monkeypatch.setattr(HostKVPool, "index", lambda self, layer: real_index(self, 0))
    _, got = _run(
        dsa_long, prompts, kv_cache_memory_bytes=24 * BLOCK_BYTES, kv_transfer_config=connector()
    )
    assert [o.outputs[0].token_ids for o in got] != [o.outputs[0].token_ids for o in want]


def test_preemption_when_the_host_pool_is_full_too(dsa_long, resident) -> None:
    """A host pool of 70 blocks (just one max_model_len request, 1,120 tokens) for
    1,720 tokens of requests: spilling runs out, requests are preempted and recomputed.
    Tokens equal the oracle's; logprobs to 1e-5, not bit for bit: a recompute turns a
    preempted request's decoded tokens into one prefill, another computation (the same
    holds without HiSparse), so their latents may differ in the last bit."""
    prompts, want = resident
    llm, got = _run(
        dsa_long,
        prompts,
        kv_cache_memory_bytes=24 * BLOCK_BYTES,
        kv_transfer_config=connector(gib=70 * BLOCK_BYTES / 2**30),
    )
    _assert_identical(got, want, tol=1e-5)
    stats = llm.llm_engine.stats()
    assert stats.num_preemptions > 0 and stats.hisparse.spills > 0


def test_speculative_verification_reads_through_hot_buffers(dsa_long) -> None:
    """n-gram drafts: each verification resolves the union of 4 query rows' selections."""
    prompts = [p * 8 for p in _prompts([50, 70], seed=6)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    _, want = _run(
        dsa_long, prompts, kv_cache_memory_bytes=200 * BLOCK_BYTES, speculative_config=spec
    )
    llm, got = _run(
        dsa_long,
        prompts,
        kv_cache_memory_bytes=24 * BLOCK_BYTES,
        kv_transfer_config=connector(),
        speculative_config=spec,
    )
    _assert_identical(got, want)
    assert llm.llm_engine.stats().hisparse.lookups > 0


def test_capacity_beyond_the_device_budget(dsa_long) -> None:
    """A device budget of C = 384 tokens (24 blocks) serves one request with a context of
    over 8 C, and three of over 2 C at once, with the tier; without it the engine refuses."""
    capacity = 24 * BLOCK
    long_prompt = _prompts([8 * capacity + 40], seed=7)
    several = _prompts([2 * capacity + 30] * 3, seed=8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    for prompts in (long_prompt, several):
        _, want = _run(
            dsa_long,
            prompts,
            params,
            max_model_len=3200,
            kv_cache_memory_bytes=600 * BLOCK_BYTES,
        )
        llm, got = _run(
            dsa_long,
            prompts,
            params,
            max_model_len=3200,
            kv_cache_memory_bytes=24 * BLOCK_BYTES,
            kv_transfer_config=connector(gib=300 * BLOCK_BYTES / 2**30),
        )
        _assert_identical(got, want)
        assert llm.llm_engine.stats().num_preemptions == 0
    with pytest.raises(ValueError, match="fewer than one max_model_len"):
        LLM(str(dsa_long), **BASE, max_model_len=3200, kv_cache_memory_bytes=24 * BLOCK_BYTES)


def test_prometheus_counters(dsa_long) -> None:
    llm, _ = _run(
        dsa_long,
        _prompts([400, 300], seed=9),
        kv_cache_memory_bytes=24 * BLOCK_BYTES,
        kv_transfer_config=connector(),
    )
    stats = llm.llm_engine.stats()
    metrics = EngineMetrics("m")
    metrics.record_stats(stats)
    text = metrics.render().decode()
    hs = stats.hisparse
    for name, value in [
        ("hisparse_cache_hits_total", hs.hits),
        ("hisparse_cache_misses_total", hs.misses),
        ("hisparse_cache_lookups_total", hs.lookups),
        ("hisparse_host_to_device_bytes_total", hs.host_to_device_bytes),
        ("hisparse_host_blocks_total", hs.host_blocks_total),
    ]:
        assert f'minivllm:{name}{{model_name="m"}} {float(value)}' in text


def test_tensor_parallel_ranks_share_one_host_pool(dsa_long, resident) -> None:
    prompts, want = resident
    before = set(glob.glob("/dev/shm/minivllm-hisparse-*"))
    llm = LLM(
        str(dsa_long),
        **BASE,
        max_model_len=1024,
        tensor_parallel_size=2,
        kv_cache_memory_bytes=24 * BLOCK_BYTES,
        kv_transfer_config=connector(),
    )
    try:
        assert set(glob.glob("/dev/shm/minivllm-hisparse-*")) == before  # mapped, unlinked
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
        assert llm.llm_engine.stats().hisparse.spills > 0
    finally:
        llm.llm_engine.shutdown()
    # TP=2's all-reduces sum in another order than TP=1: equal tokens, logprobs within 1e-4
    _assert_identical(got, want, tol=1e-4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(attention_config={"hisparse_config": {}}), "HiSparse, which is off"),
        (dict(kv_transfer_config={"kv_connector": "NixlConnector"}), "no KV connector"),
        (
            dict(kv_transfer_config={"kv_connector": "HiSparseConnector"}),
            "host_pool_gib",
        ),
        (
            dict(
                kv_transfer_config=connector(),
                attention_config={"hisparse_config": {"device_buffer_size": 8}},
            ),
            "cannot hold one step's selection",
        ),
        (dict(kv_transfer_config=connector(gib=0.0001)), "raise host_pool_gib"),
    ],
)
def test_configuration_errors(dsa_long, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(str(dsa_long), **BASE, max_model_len=1024, **kwargs)


def test_a_model_without_an_indexer_is_refused(make_checkpoint) -> None:
    with pytest.raises(ValueError, match="HiSparse serves sparse-attention models"):
        LLM(str(make_checkpoint("Qwen3ForCausalLM")), kv_transfer_config=connector())


def test_bf16_kernel_path_identical_with_host_tier(dsa_long) -> None:
    """bf16 with the compiled DSA ops where this CPU has them (the path users run)."""
    prompts = _prompts([300, 520, 200], seed=11)
    bf16 = dict(dtype="bfloat16", max_num_batched_tokens=64)
    half = BLOCK_BYTES // 2
    _, want = _run(dsa_long, prompts, kv_cache_memory_bytes=300 * half, **bf16)
    llm, got = _run(
        dsa_long,
        prompts,
        kv_cache_memory_bytes=24 * half,
        kv_transfer_config=connector(),
        **bf16,
    )
    _assert_identical(got, want)
    assert llm.llm_engine.stats().hisparse.misses > 0


def test_server_with_the_host_tier(tmp_path) -> None:
    """`minivllm serve demo-sparse --kv-transfer-config ...` answers the real openai client
    with the all-resident engine's tokens, and /metrics shows the tier's counters."""
    import httpx
    import openai

    from tests.server_utils import RemoteServer

    # demo-sparse: 2 layers x 16 tokens x (latent 80 + index key 32) float32 values a block
    block_bytes = 2 * 16 * (80 + 32) * 4
    common = ["--dtype", "float32", "--block-size", "16", "--max-num-batched-tokens", "64"]
    tier = json.dumps(connector(gib=0.01))
    server = RemoteServer(
        "demo-sparse",
        [*common, "--kv-cache-memory-bytes", str(24 * block_bytes), "--kv-transfer-config", tier],
        tmp_path / "server.log",
    )
    prompt = " ".join(["The os module provides a portable way of using the system."] * 40)
    try:
        client = openai.OpenAI(base_url=server.wait_ready().url + "/v1", api_key="none")
        got = client.completions.create(
            model="demo-sparse", prompt=prompt, max_tokens=24, temperature=0
        )
        metrics = httpx.get(server.url + "/metrics").text
    finally:
        server.stop()
    want = LLM(
        "demo-sparse",
        dtype="float32",
        block_size=16,
        max_num_batched_tokens=64,
        kv_cache_memory_bytes=200 * block_bytes,
    ).generate(prompt, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
    assert got.choices[0].text == want[0].outputs[0].text
    misses = re.search(r"^minivllm:hisparse_cache_misses_total\{[^}]*\} (\S+)", metrics, re.M)
    assert misses is not None and float(misses.group(1)) > 0


def test_a_lone_request_at_the_minimum_budget_progresses(dsa_long) -> None:
    """With 128-token chunks (8 pages) and the least device budget HiSparse accepts (hot
    buffer, tail pages, one chunk), a long prompt still runs through without preemption:
    the pages written in the previous step are spillable in this one. (Protecting them
    too once made this request preempt itself and recompute forever.)"""
    prompt = _prompts([700], seed=13)[0]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kwargs = dict(BASE, max_num_batched_tokens=128, max_model_len=1024)
    want = LLM(str(dsa_long), kv_cache_memory_bytes=100 * BLOCK_BYTES, **kwargs).generate(
        [{"prompt_token_ids": prompt}], params, use_tqdm=False
    )
    least = 2 + 3 + 8  # hot buffer (2 x index_topk rows), tail pages + 1, one chunk
    llm = LLM(
        str(dsa_long),
        kv_cache_memory_bytes=least * BLOCK_BYTES,
        kv_transfer_config=connector(),
        **kwargs,
    )
    with pytest.raises(ValueError, match="one request needs 13"):
        LLM(
            str(dsa_long),
            kv_cache_memory_bytes=(least - 1) * BLOCK_BYTES,
            kv_transfer_config=connector(),
            **kwargs,
        )
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": prompt}, params)
    outputs = []
    for _ in range(200):  # 6 prefill chunks and 8 tokens need 14 steps
        outputs += engine.step()
        if not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    assert engine.stats().num_preemptions == 0 and engine.stats().hisparse.spills > 0
    assert outputs[-1].outputs[0].token_ids == want[0].outputs[0].token_ids
