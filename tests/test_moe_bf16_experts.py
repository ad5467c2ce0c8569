"""Quantized routed experts in bf16 engines on the AVX512-BF16 kernels: each expert's
products on `quant_linear` against the plain-PyTorch reference, and the layer's one call
(kernels/moe_quant.cpp) against the Python routing loop it replaces, bit for bit. The
float32 engines' side is tests/test_moe_quantization.py, whose model and prompts these
share.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from minivllm import LLM
from tests.conftest import assert_prompt_logprobs_close
from tests.test_deepseek_v32 import build_dsa_checkpoint
from tests.test_moe_quantization import ENGINE, EXPERTS_ONLY, GROUPS, PARAMS, PROMPTS
from tests.test_quantization import needs_kernels

BF16 = dict(ENGINE, dtype="bfloat16")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, tokenizer_dir) -> Path:
    return build_dsa_checkpoint(tmp_path_factory.mktemp("moe-bf16"), tokenizer_dir)


@needs_kernels
@pytest.mark.parametrize(
    ("scheme", "options"),
    [
        ("int8_w8a16", {}),
        ("fp8_w8a16", {}),
        ("int4_w4a16", GROUPS),
        ("int8_w8a8", {}),
        ("int4_w4a8", GROUPS),
    ],
)
def test_bf16_expert_kernels_agree_with_the_reference_backend(moe_dir, scheme, options) -> None:
    """A bf16 engine's quantized experts on the bf16 kernels (quant_linear, expert by
    expert in the routing loop) against the plain-PyTorch reference: both round each
    product's float32 sums once to bf16, so prompt logprobs differ by bf16 rounding
    propagated through this model's 3 layers only (the dense test's bound)."""
    config = {"targets": {EXPERTS_ONLY: {"scheme": scheme, **options}}}
    runs = {}
    for backend in ("cpu_kernel", "torch"):
        llm = LLM(
            str(moe_dir),
            **BF16,
            quantization="online",
            quantization_config=config,
            kernel_config={"linear_backend_per_quant": {scheme: backend}},
        )
        method = llm.llm_engine.executor.runner.model.model.layers[1].mlp.experts.quant_method
        assert method.op_name.startswith("torch") == (backend == "torch"), method.op_name
        runs[backend] = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False
        )
        llm.llm_engine.shutdown()
    assert_prompt_logprobs_close(runs["cpu_kernel"], runs["torch"])


@needs_kernels
@pytest.mark.parametrize(
    ("scheme", "options"),
    [
        ("int8_w8a16", {}),
        ("fp8_w8a16", {}),
        ("int4_w4a16", GROUPS),
        ("int8_w8a8", {}),
        ("int4_w4a8", GROUPS),
    ],
)
def test_bf16_one_call_equals_the_routing_loop_bit_for_bit(moe_dir, scheme, options) -> None:
    """A bf16 engine runs a layer's quantized experts in one call (moe_quant.cpp) that
    does what the Python routing loop does with quant_linear per expert, with the same
    ATen SiLU and roundings: equal bits, on batches that leave experts idle, give two
    experts every token, and a single token; past the kernels' rows the loop serves."""
    config = {"targets": {EXPERTS_ONLY: {"scheme": scheme, **options}}}
    llm = LLM(
        str(moe_dir), **BF16, quantization="online",
        quantization_config=config,
    )  # fmt: skip
    layer = llm.llm_engine.executor.runner.model.model.layers[1].mlp.experts
    method = layer.quant_method
    assert method.bf16_moe_op is not None and "moe_quant_experts" in method.op_name
    one_call = method.bf16_moe_op
    num_experts, hidden = layer.num_experts, method.stacked["w2"].out_features // layer.num_experts
    gen = torch.Generator().manual_seed(0)
    for tokens, ids in [
        (7, torch.stack([torch.randperm(num_experts, generator=gen)[:2] for _ in range(7)])),
        (3, torch.tensor([[4, 1]] * 3)),  # experts 1 and 4 take every token, the rest none
        (1, torch.tensor([[5, 0]])),
    ]:
        x = torch.randn(tokens, hidden, generator=gen).bfloat16()
        weights = torch.rand(tokens, 2, generator=gen)
        got = method.apply(layer, x, weights, ids)
        method.bf16_moe_op = None  # the Python loop, an op per expert
        try:
            want = method.apply(layer, x, weights, ids)
        finally:
            method.bf16_moe_op = one_call
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), (
            tokens,
            (got - want).abs().max(),
        )
    with pytest.raises(RuntimeError, match="picks expert 3 twice"):
        method.apply(layer, x, weights, torch.tensor([[3, 3]]))
    with pytest.raises(RuntimeError, match="out of"):
        method.apply(layer, x, weights, torch.tensor([[0, num_experts]]))
    # past the kernels' rows: int8_w8a8's one call runs each expert's prepacked copy, as
    # the loop does (int4_w4a8's runs its experts' panels at every step); the weight-only
    # schemes leave the step to the loop (dequantize + GEMM)
    prepacked = scheme in ("int8_w8a8", "int4_w4a8")
    rows = method.kernel_rows + 1
    assert bool(method.packed["w13"]) == prepacked
    x = torch.randn(rows, hidden, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:2] for _ in range(rows)])
    weights = torch.rand(rows, 2, generator=gen)
    calls = []
    method.bf16_moe_op = lambda *args: calls.append(args) or one_call(*args)
    try:
        got = method.apply(layer, x, weights, ids)
        method.bf16_moe_op = None
        want = method.apply(layer, x, weights, ids)
    finally:
        method.bf16_moe_op = one_call
    assert len(calls) == prepacked and torch.equal(got, want)
    llm.llm_engine.shutdown()


@needs_kernels
def test_experts_whose_down_projection_the_kernel_cannot_take_stay_on_the_loop(
    tmp_path, tokenizer_dir
) -> None:
    """Experts of 48 rows: gate/up (K = 64) run on quant_linear, the down projection
    (K = 48, no multiple of 32) on the reference, so the layer keeps the Python loop
    rather than a one call that would refuse K = 48; it generates as the reference does."""
    moe = build_dsa_checkpoint(tmp_path / "moe48", tokenizer_dir, moe_intermediate_size=48)
    config = {"targets": {EXPERTS_ONLY: "int8_w8a16"}}
    runs = {}
    for backend in ("cpu_kernel", "torch"):
        kernel = (
            {"linear_backend_per_quant": {"int8_w8a16": backend}} if backend == "torch" else None
        )
        llm = LLM(
            str(moe), **BF16, quantization="online",
            quantization_config=config, kernel_config=kernel,
        )  # fmt: skip
        method = llm.llm_engine.executor.runner.model.model.layers[1].mlp.experts.quant_method
        assert method.bf16_moe_op is None
        if backend == "cpu_kernel":
            assert method.experts["w13"][0].op is not None and method.experts["w2"][0].op is None
        runs[backend] = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False
        )
        llm.llm_engine.shutdown()
    assert_prompt_logprobs_close(runs["cpu_kernel"], runs["torch"])


@needs_kernels
@pytest.mark.parametrize(("scheme", "options"), [("int8_w8a8", {}), ("int4_w4a8", GROUPS)])
def test_weight_cache_serves_the_experts_prepacked_copies(moe_dir, tmp_path, scheme, options):
    """A weight cache daemon holds the routed experts' prepacked GEMM copies (int8_w8a8's,
    int4_w4a8's panels) as one stack per part; a mapping engine runs the one call on views
    of the mapped stack, equal to what it would pack from the mapped rows, and generates
    what a disk-loading engine does."""
    from minivllm.quantization.moe_method import PARTS
    from tests.test_weight_cache import mapping_of
    from tests.weight_cache_harness import Daemon, assert_same_outputs, short_dir

    config = {"targets": {EXPERTS_ONLY: {"scheme": scheme, **options}}}
    quant = dict(quantization="online", quantization_config=config)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    disk = LLM(str(moe_dir), **BF16, **quant)
    expected = disk.generate(prompts, PARAMS, use_tqdm=False)
    disk_layer = disk.llm_engine.executor.runner.model.model.layers[1].mlp.experts
    disk_stacks = {part: getattr(disk_layer, f"{part}_packed").clone() for part in PARTS}
    # the panels serve every product (int4_w4a8's; int8_w8a8's VNNI ones, not AMX's
    # blocks): the experts keep no row copy of the weight
    rowless = scheme == "int4_w4a8" or disk_stacks["w13"][0].dim() == 4
    assert (disk_layer.w13_weight.numel() == 0) == rowless
    disk.llm_engine.shutdown()
    socket_dir = short_dir()
    args = ["--quantization", "online", "--quantization-config", json.dumps(config)]
    daemon = Daemon(moe_dir, socket_dir, tmp_path / "daemon.log", *args)
    try:
        daemon.wait_ready()
        extra = {"socket_dir": str(socket_dir), "fallback": False}
        llm = LLM(
            str(moe_dir), load_format="ipc_cache", model_loader_extra_config=extra, **BF16, **quant
        )
        assert_same_outputs(llm.generate(prompts, PARAMS, use_tqdm=False), expected)
        layer = llm.llm_engine.executor.runner.model.model.layers[1].mlp.experts
        method = layer.quant_method
        assert method.bf16_moe_op is not None
        for part in PARTS:
            stack = getattr(layer, f"{part}_packed")
            assert "memfd:minivllm-weights" in mapping_of(stack.data_ptr())[1]
            assert torch.equal(stack, disk_stacks[part])  # what the disk engine packed
            rows = getattr(layer, f"{part}_weight")
            assert (rows.numel() == 0) == rowless  # mapped rowless, as held
            for e, expert in enumerate(method.experts[part]):
                qw = expert.quant_weights
                assert (
                    qw.packed.data_ptr() == stack[e].data_ptr() == method.packed[part][e].data_ptr()
                )
        llm.llm_engine.shutdown()
    finally:
        daemon.stop()
        shutil.rmtree(socket_dir)
