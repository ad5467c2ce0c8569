"""DeepSeek's MoE layer on its own: the router's group-limited top-k (PyTorch ops and the
compiled op, `kernels/moe_routing.cpp`) against transformers and each other, and the
routed experts as bf16 panels in fp32 engines (`kernels/avx2_moe.cpp`'s moe_bf16w)
against the float32 reference, and through the weight cache."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.layers.moe import FusedMoE, GroupedTopKRouter, grouped_topk, moe_reference
from tests.test_deepseek_v32 import DSA, ENGINE, _prompts, build_dsa_checkpoint


def _compiled_grouped_topk():
    """The CPU kernels' routing op (AVX2 family, which every CPU with AVX-512 has too)."""
    from minivllm.kernels.registry import select_kernels

    op = select_kernels("cpu", torch.float32).op("moe_grouped_topk")
    if op is None:
        pytest.skip("no compiled CPU kernels here (needs AVX2 + FMA and a compiler)")
    return op


@pytest.mark.parametrize("route", ["torch", "compiled"])
def test_grouped_routing_and_experts_against_transformers(route) -> None:
    from transformers import DeepseekV32Config
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32MoE

    config = DeepseekV32Config(**DSA)
    torch.manual_seed(0)
    moe = DeepseekV32MoE(config).eval()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    moe.gate.e_score_correction_bias.normal_(std=0.2)
    x = torch.randn(30, DSA["hidden_size"])
    with torch.no_grad():
        _, want_w, want_ids = moe.gate(x)
        topk = grouped_topk if route == "torch" else _compiled_grouped_topk()
        weights, ids = topk(
            torch.nn.functional.linear(x, moe.gate.weight),
            moe.gate.e_score_correction_bias,
            2,
            4,
            2,
            True,
            2.5,
        )
        order_w, order_got = want_ids.sort(dim=1), ids.sort(dim=1)
        assert torch.equal(order_w.values, order_got.values)
        torch.testing.assert_close(
            weights.gather(1, order_got.indices), want_w.gather(1, order_w.indices)
        )
        routed = moe_reference(x, moe.experts.gate_up_proj, moe.experts.down_proj, weights, ids)
        want = moe.experts(x, want_ids, want_w)
    torch.testing.assert_close(routed, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "experts, groups, topk_group, top_k, bias, renormalize, tokens",
    [
        (16, 4, 2, 3, True, True, 7),
        (32, 8, 3, 8, True, True, 300),  # tokens split across threads
        (64, 1, 1, 6, False, False, 5),  # no groups (Qwen-style softmax-free sigmoid)
        (8, 2, 1, 4, True, False, 1),  # top_k fills the one group allowed
        (32, 8, 8, 4, True, True, 9),  # every group allowed
    ],
)
def test_compiled_routing_equals_the_reference(
    experts, groups, topk_group, top_k, bias, renormalize, tokens
) -> None:
    """moe_routing.cpp against grouped_topk: the same experts chosen and the same weights
    (ids compared as sets per token: both leave the order within a token open)."""
    op = _compiled_grouped_topk()
    gen = torch.Generator().manual_seed(experts + tokens)
    logits = torch.randn(tokens, experts, generator=gen) * 2
    correction = torch.randn(experts, generator=gen) * 0.3 if bias else None
    args = (top_k, groups, topk_group, renormalize, 2.5)
    want_w, want_ids = grouped_topk(logits, correction, *args)
    got_w, got_ids = op(logits, correction, *args)
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32
    order_w, order_got = want_ids.sort(dim=1), got_ids.sort(dim=1)
    assert torch.equal(order_w.values, order_got.values)
    torch.testing.assert_close(
        got_w.gather(1, order_got.indices), want_w.gather(1, order_w.indices), rtol=1e-6, atol=0
    )


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("groups, topk_group", [(4, 2), (1, 1)])
def test_compiled_routing_ranks_nan_first_as_torch_does(renormalize, groups, topk_group) -> None:
    """A NaN router logit (a diverged model): torch.topk ranks NaN above every number,
    so the reference picks that expert's group and the expert itself; the op too, and
    the token's weights are NaN where the reference's are."""
    op = _compiled_grouped_topk()
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 16, generator=gen)
    logits[0, 5] = logits[2, 12] = logits[2, 1] = float("nan")
    correction = torch.randn(16, generator=gen) * 0.3
    args = (3, groups, topk_group, renormalize, 1.0)
    want_w, want_ids = grouped_topk(logits, correction, *args)
    got_w, got_ids = op(logits, correction, *args)
    order_w, order_got = want_ids.sort(dim=1), got_ids.sort(dim=1)
    assert torch.equal(order_w.values, order_got.values)
    assert {5} <= set(got_ids[0].tolist()) and {1, 12} <= set(got_ids[2].tolist())
    torch.testing.assert_close(
        got_w.gather(1, order_got.indices), want_w.gather(1, order_w.indices), equal_nan=True
    )
    assert got_w[[1, 3]].isfinite().all()
    # a NaN in the bias: every token picks that expert, with its finite weight
    correction[9] = float("nan")
    want_w, want_ids = grouped_topk(logits[[1, 3]], correction, *args)
    got_w, got_ids = op(logits[[1, 3]], correction, *args)
    assert (got_ids == 9).any(dim=1).all() and torch.equal(
        want_ids.sort(dim=1).values, got_ids.sort(dim=1).values
    )
    torch.testing.assert_close(got_w.sort(dim=1).values, want_w.sort(dim=1).values)


def test_compiled_routing_refuses_bad_shapes() -> None:
    op = _compiled_grouped_topk()
    logits = torch.randn(3, 16)
    with pytest.raises(RuntimeError, match="must divide"):
        op(logits, None, 2, 5, 1, True, 1.0)
    with pytest.raises(RuntimeError, match="top_k=9"):
        op(logits, None, 9, 4, 2, True, 1.0)
    with pytest.raises(RuntimeError, match="correction_bias"):
        op(logits, torch.zeros(15), 2, 4, 2, True, 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        op(logits.double(), None, 2, 4, 2, True, 1.0)
    with pytest.raises(ValueError, match="topk_group"):
        GroupedTopKRouter(8, 16, top_k=9, num_groups=4, topk_group=2)


@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_bf16_valued_experts_as_panels_equal_the_reference(tokens) -> None:
    """An fp32 engine on the AVX2 kernels holds bf16-valued experts as bf16 panels and
    runs them in one call (avx2_moe.cpp's moe_bf16w): the routed output of the float32
    weights, up to summation order; experts with other values stay float32."""
    from minivllm.kernels.registry import select_kernels

    kernels = select_kernels("cpu", torch.float32)
    if kernels.op("moe_bf16w") is None:
        pytest.skip("no AVX2 kernels here")
    gen = torch.Generator().manual_seed(tokens)
    experts, hidden, inter, top_k = 8, 48, 40, 3  # 2I = 80, 48: neither a multiple of 32
    moe = FusedMoE(experts, hidden, inter)
    moe.w13.data = (torch.randn(experts, 2 * inter, hidden, generator=gen) / 7).bfloat16().float()
    moe.w2.data = (torch.randn(experts, hidden, inter, generator=gen) / 6).bfloat16().float()
    w13, w2 = moe.w13.data.clone(), moe.w2.data.clone()
    x = torch.randn(tokens, hidden, generator=gen)
    weights = torch.rand(tokens, top_k, generator=gen)
    ids = torch.stack([torch.randperm(experts - 2, generator=gen)[:top_k] for _ in range(tokens)])
    moe.process_weights_after_loading(kernels)
    assert moe.panels_op is not None and moe.w13.dtype == torch.bfloat16
    assert moe.w13.shape == (experts, 5, hidden, 16) and moe.w2.shape == (experts, 3, inter, 16)
    with torch.no_grad():
        got = moe(x, weights, ids)
    torch.testing.assert_close(got, moe_reference(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
    other = FusedMoE(experts, hidden, inter)
    other.w13.data, other.w2.data = w13.clone(), w2 + 1e-3  # w2 not bf16 values
    other.process_weights_after_loading(kernels)
    assert other.panels_op is None and other.w13.dtype == torch.float32


def test_weight_cache_maps_expert_panels(tmp_path, tokenizer_dir) -> None:
    """A daemon started with --dtype float32 holds a bf16-valued checkpoint's experts as
    the panels; a mapping engine runs them as they are, with the disk load's outputs."""
    from minivllm.kernels.registry import select_kernels
    from tests.test_weight_cache import mapping_of
    from tests.weight_cache_harness import Daemon, assert_same_outputs, short_dir

    if select_kernels("cpu", torch.float32).op("moe_bf16w") is None:
        pytest.skip("no AVX2 kernels here")
    path = build_dsa_checkpoint(tmp_path / "moe-bf16-valued", tokenizer_dir, round_to_bf16=True)
    prompts = [{"prompt_token_ids": p} for p in _prompts([20, 50], seed=3)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    disk = LLM(str(path), **ENGINE)
    expected = disk.generate(prompts, greedy, use_tqdm=False)
    disk.llm_engine.shutdown()
    socket_dir = short_dir()
    daemon = Daemon(path, socket_dir, tmp_path / "daemon.log", "--dtype", "float32")
    try:
        daemon.wait_ready()
        extra = {"socket_dir": str(socket_dir), "fallback": False}
        llm = LLM(str(path), load_format="ipc_cache", model_loader_extra_config=extra, **ENGINE)
        assert_same_outputs(llm.generate(prompts, greedy, use_tqdm=False), expected)
        layer = llm.llm_engine.executor.runner.model.model.layers[1].mlp.experts
        assert layer.panels_op is not None and layer.w13.dim() == 4
        assert "memfd:minivllm-weights" in mapping_of(layer.w13.data_ptr())[1]
        llm.llm_engine.shutdown()
    finally:
        daemon.stop()
