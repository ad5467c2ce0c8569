"""Quantized routed experts (quantization/moe_method.py) against transformers.

The oracle is transformers' DeepseekV32ForCausalLM in float32 with every layer we
quantized holding its quantize-then-dequantize image: the linears' weights and, for the
routed experts, the stacked `gate_up_proj` / `down_proj` rows (each row's scale is its
own, so the stack quantizes as its experts would one by one). For the schemes that
quantize activations too, the oracle's experts round each input row trip through int8
as the scheme says, written here independently of formats.py. Our float32 engine runs
its default ops (the AVX2 kernels where the CPU has them): logprobs agree within
QUANTIZED_FP32_TOL, as the dense models' quantized layers do (test_quantization.py).
"""

from __future__ import annotations

import dataclasses
import logging
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minivllm import LLM, SamplingParams
from minivllm.kernels.isa import cpu_flags
from minivllm.quantization import formats
from minivllm.quantization.method import QuantizedLinearMethod
from minivllm.quantization.moe_method import QuantizedMoEMethod
from tests.conftest import QUANTIZED_FP32_TOL, assert_logprobs_match, needs_avx2
from tests.test_deepseek_v32 import _prompts, build_dsa_checkpoint
from tests.test_quantization import _hf_names

ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=8 << 20)
# hidden 64, expert intermediate 32: int4 groups of 32 divide every input
GROUPS = {"group_size": 32}
PROMPTS = _prompts([6, 23, 41], seed=3)
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1, prompt_logprobs=1)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, tokenizer_dir) -> Path:
    return build_dsa_checkpoint(tmp_path_factory.mktemp("moe-quant"), tokenizer_dir)


def _methods(llm: LLM) -> dict[str, object]:
    model = llm.llm_engine.executor.runner.model
    return {n: m.quant_method for n, m in model.named_modules() if hasattr(m, "quant_method")}


def _round_trip(x: torch.Tensor, group: int) -> torch.Tensor:
    """x rounded to int8 with one scale per row (group 0) or per row and group of k."""
    shape = x.shape
    if group:
        x = x.reshape(*shape[:-1], shape[-1] // group, group)
    amax = x.abs().amax(-1, keepdim=True)
    amax = torch.where(amax == 0, torch.ones_like(amax), amax)
    return (torch.round(x * (127 / amax)) * (amax / 127)).reshape(shape)


def _dequantized(w: torch.Tensor, spec) -> torch.Tensor:
    rows = w.reshape(-1, w.shape[-1])
    qw = formats.quantize(rows, spec.scheme, spec.group_size, spec.symmetric)
    return formats.dequantize(qw).reshape(w.shape)


def _activation_group(spec) -> int | None:
    """How the scheme rounds a linear's input: None (it does not), 0 per row, else per group."""
    return {"int8_w8a8": 0, "int4_w4a8": spec.group_size}.get(spec.scheme)


def _quantized_experts_forward(group: int | None):
    """DeepseekV32Experts.forward with each product's input put through `_round_trip`."""

    def forward(self, hidden, top_k_index, top_k_weights):
        def linear(x, w):
            return F.linear(x if group is None else _round_trip(x, group), w)

        out = torch.zeros_like(hidden)
        for e in top_k_index.unique().tolist():
            token, slot = torch.where(top_k_index == e)
            gate, up = linear(hidden[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            h = linear(F.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, token, h * top_k_weights[token, slot, None])
        return out

    return forward


def _oracle(model_dir: Path, llm: LLM):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    modules = dict(hf.named_modules())
    with torch.no_grad():
        for name, method in _methods(llm).items():
            if isinstance(method, QuantizedMoEMethod):
                experts = modules[name]
                for param in (experts.gate_up_proj, experts.down_proj):
                    param.copy_(_dequantized(param.data, method.spec))
                group = _activation_group(method.spec)
                experts.forward = types.MethodType(_quantized_experts_forward(group), experts)
            elif isinstance(method, QuantizedLinearMethod):
                for hf_name in _hf_names(name):
                    linear = modules[hf_name]
                    linear.weight.copy_(_dequantized(linear.weight.data, method.spec))
                    group = _activation_group(method.spec)
                    if group is not None:
                        linear.register_forward_pre_hook(
                            lambda _m, args, g=group: (_round_trip(args[0], g),)
                        )
    return hf


EXPERTS_ONLY = "re:.*mlp\\.experts$"


@pytest.mark.parametrize(
    ("quantization", "options"),
    [
        ("int8", None),
        ("fp8", None),
        ("int4", GROUPS),
        ("int4", {**GROUPS, "symmetric": False}),
        # the schemes that round activations, on the experts alone: an input a hair from
        # a rounding boundary (x * 127 / amax at k + 1/2) rounds either way under the two
        # sides' different summation orders, and across this model's many small linears
        # such flips move a logprob by up to 1e-2 (the dense models' test keeps them all)
        ("online", {"targets": {EXPERTS_ONLY: "int8_w8a8"}}),
        ("online", {"targets": {EXPERTS_ONLY: {"scheme": "int4_w4a8", **GROUPS}}}),
    ],
)
def test_routed_experts_quantize_as_transformers_would(moe_dir, quantization, options) -> None:
    llm = LLM(str(moe_dir), **ENGINE, quantization=quantization, quantization_config=options)
    methods = _methods(llm)
    experts = {n: m for n, m in methods.items() if n.endswith("mlp.experts")}
    assert len(experts) == 2 and all(isinstance(m, QuantizedMoEMethod) for m in experts.values())
    layer = llm.llm_engine.executor.runner.model.model.layers[1].mlp.experts
    assert not hasattr(layer, "w13") and not hasattr(layer, "w2")  # the full weights are gone
    # fp32 engines on the AVX2 family run a layer's experts in one call (avx2_moe.cpp)
    one_call = bool(cpu_flags() >= {"avx2", "fma", "f16c"})
    assert (layer.quant_method.moe_op is not None) == one_call
    assert ("moe_quantw" in layer.quant_method.op_name) == one_call
    integer = layer.quant_method.spec.scheme.startswith("int8")
    assert (
        layer.w13_weight.dtype == layer.w2_weight.dtype == (torch.int8 if integer else torch.uint8)
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    assert_logprobs_match(_oracle(moe_dir, llm), PROMPTS, outputs, tol=QUANTIZED_FP32_TOL)
    llm.llm_engine.shutdown()


def test_targets_reach_experts_alone_and_log_them(moe_dir, caplog) -> None:
    config = {"targets": {EXPERTS_ONLY: {"scheme": "int4_w4a16", "group_size": 32}}}
    with caplog.at_level(logging.INFO, logger="minivllm"):
        llm = LLM(str(moe_dir), **ENGINE, quantization="online", quantization_config=config)
    methods = _methods(llm)
    quantized = sorted(n for n, m in methods.items() if not type(m).__name__.startswith("Unq"))
    assert quantized == ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts"]
    assert "quantized 2 layers as int4_w4a16 (group 32, symmetric)" in caplog.text
    assert "mlp.experts: 2" in caplog.text
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    assert_logprobs_match(_oracle(moe_dir, llm), PROMPTS, outputs, tol=QUANTIZED_FP32_TOL)


def test_the_reference_backend_agrees_with_the_kernel(moe_dir) -> None:
    """`linear_backend_per_quant` reaches the experts: the plain-PyTorch reference gives
    what the default op gives (a second code path)."""
    runs = []
    for backend in (None, "torch"):
        kernel = {"linear_backend_per_quant": {"int8_w8a16": backend}} if backend else None
        llm = LLM(str(moe_dir), **ENGINE, quantization="int8", kernel_config=kernel)
        layer = llm.llm_engine.executor.runner.model.model.layers[1].mlp.experts
        assert layer.quant_method.op_name.startswith("torch") == (backend == "torch")
        runs.append(
            llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
        )
        llm.llm_engine.shutdown()
    for kernel, reference in zip(*runs, strict=True):
        assert kernel.outputs[0].token_ids == reference.outputs[0].token_ids
        got = [next(iter(d.values())).logprob for d in kernel.outputs[0].logprobs]
        want = [next(iter(d.values())).logprob for d in reference.outputs[0].logprobs]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < QUANTIZED_FP32_TOL


@pytest.mark.parametrize(
    ("config", "error"),
    [
        # every projection targeted, by two schemes: one MoE layer's experts have one
        (
            {
                "targets": {
                    "*experts.*.down_proj": "int8",
                    "re:.*experts\\.\\d+\\.(gate|up)_proj": "fp8",
                }
            },
            "map to different schemes",
        ),
        (
            {"targets": {"*experts.*.gate_proj": "int8", "*experts.*_proj": "fp8"}},
            "more than one target",
        ),
        (
            {"targets": {"*": "int8"}, "ignore": ["model.layers.1.mlp.experts"]},
            "matches both `ignore` and the target",
        ),
        # the layer's name targeted one way, some of its projections another
        (
            {"targets": {"re:.*mlp\\.experts$": "int8", "re:.*experts\\.\\d+\\.down": "fp8"}},
            "give some of their projections another scheme",
        ),
    ],
)
def test_expert_targets_follow_the_fused_layer_rules(moe_dir, config, error) -> None:
    with pytest.raises(ValueError, match=error):
        LLM(str(moe_dir), **ENGINE, quantization="online", quantization_config=config)


def test_a_linear_pattern_that_catches_some_expert_projections_leaves_them_be(
    moe_dir, caplog
) -> None:
    """`*.down_proj` means the MLPs' down projections; on a MoE model it also matches
    the experts' down projections but not their gate and up ones. vLLM matches experts
    by the MoE layer's name alone, so the experts stay unquantized, with a warning
    that says how to target them, and the linears are quantized."""
    with caplog.at_level(logging.INFO, logger="minivllm"):
        llm = LLM(
            str(moe_dir),
            **ENGINE,
            quantization="online",
            quantization_config={"targets": {"*.down_proj": "int8"}},
        )
    methods = _methods(llm)
    assert methods["model.layers.1.mlp.experts"] is None
    assert isinstance(methods["model.layers.1.mlp.shared_experts.down_proj"], QuantizedLinearMethod)
    assert isinstance(methods["model.layers.0.mlp.down_proj"], QuantizedLinearMethod)
    assert "'*.down_proj' matches some of the routed experts' projections in 2" in caplog.text
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    assert_logprobs_match(_oracle(moe_dir, llm), PROMPTS, outputs, tol=QUANTIZED_FP32_TOL)


def test_an_ignore_that_catches_some_expert_projections_keeps_the_experts(moe_dir, caplog) -> None:
    """`ignore: ["*.down_proj"]` with a shorthand keeps the MLPs' down projections and,
    since it catches the experts' down projections too, the whole experts layer (one
    precision per MoE layer), with a warning naming the pattern."""
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        llm = LLM(
            str(moe_dir),
            **ENGINE,
            quantization="int8",
            quantization_config={"ignore": ["*.down_proj"]},
        )
    methods = _methods(llm)
    assert methods["model.layers.2.mlp.experts"] is None
    assert methods["model.layers.0.mlp.down_proj"].__class__.__name__ == "UnquantizedLinearMethod"
    assert isinstance(methods["model.layers.0.mlp.gate_up_proj"], QuantizedLinearMethod)
    assert "`ignore` pattern '*.down_proj' matches some of the routed experts'" in caplog.text
    llm.llm_engine.shutdown()


def test_every_expert_shard_targeted_quantizes_the_layer_and_ignore_carves_it_out(
    moe_dir,
) -> None:
    config = {"targets": {"re:.*experts\\.\\d+\\.(gate|up|down)_proj": "int8"}}
    llm = LLM(str(moe_dir), **ENGINE, quantization="online", quantization_config=config)
    assert sum(isinstance(m, QuantizedMoEMethod) for m in _methods(llm).values()) == 2
    llm.llm_engine.shutdown()
    # a shorthand's ignore leaves that layer's experts in full precision
    llm = LLM(
        str(moe_dir),
        **ENGINE,
        quantization="int8",
        quantization_config={"ignore": ["model.layers.1.mlp.experts"]},
    )
    methods = _methods(llm)
    assert methods["model.layers.1.mlp.experts"] is None
    assert isinstance(methods["model.layers.2.mlp.experts"], QuantizedMoEMethod)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    assert_logprobs_match(_oracle(moe_dir, llm), PROMPTS, outputs, tol=QUANTIZED_FP32_TOL)


def test_groups_that_do_not_divide_the_experts_are_an_error(moe_dir) -> None:
    config = {"targets": {EXPERTS_ONLY: {"scheme": "int4", "group_size": 64}}}
    with pytest.raises(ValueError, match="down_proj's 32 input features on this rank.*group_size"):
        LLM(str(moe_dir), **ENGINE, quantization="online", quantization_config=config)


def _loop_with_op_silu(ops, x, weights, ids, up, down) -> torch.Tensor:
    """layers/moe.routed_experts' loop with the AVX2 silu_and_mul in place of F.silu."""
    out = torch.zeros_like(x)
    for expert in ids.unique().tolist():
        token_idx, slot = torch.where(ids == expert)
        h = down(expert, ops.silu_and_mul(up(expert, x[token_idx])))
        out[token_idx] += h * weights[token_idx, slot, None]
    return out


@needs_avx2
@pytest.mark.parametrize(
    ("scheme", "group", "symmetric"),
    [
        ("int8_w8a16", 0, True),
        ("int8_w8a8", 0, True),
        ("int4_w4a16", 32, False),
        ("int4_w4a8", 64, True),
        ("fp8_w8a16", 0, True),
        ("fp8_w8a16", 32, True),  # block-scaled (DeepSeek's fp8): a scale per row and 32 k
    ],
)
def test_one_call_per_layer_equals_the_routing_loop(scheme, group, symmetric) -> None:
    """avx2_moe.cpp's moe_quantw runs what layers/moe.routed_experts does with the AVX2
    linear_quantw per expert, on token batches that leave experts idle, give two
    experts every token, and a single token."""
    from minivllm.kernels import get_avx2_kernels

    ops = get_avx2_kernels()
    torch.manual_seed(0)
    num_experts, hidden, inter, top = 6, 128, 64, 2
    stacks = {}
    for part, (rows, k) in {"w13": (2 * inter, hidden), "w2": (hidden, inter)}.items():
        w = torch.randn(num_experts * rows, k) * 0.05
        if scheme == "fp8_w8a16" and group:  # scales per row and group of k, as loaded
            g = w.unflatten(-1, (-1, group)).abs().amax(-1) / formats.FP8_MAX
            q = (w / g.repeat_interleave(group, -1)).to(torch.float8_e4m3fn)
            stacks[part] = formats.from_fp8_values(q, g, group)
        else:
            stacks[part] = formats.quantize(w, scheme, group or 128, symmetric)

    def cut(qw, e, rows):
        part = slice(e * rows, (e + 1) * rows)
        zero = None if qw.zero is None else qw.zero[part]
        return qw.weight[part], qw.scale[part], zero

    def linear(part, rows):
        qw = stacks[part]
        if scheme == "int8_w8a8":
            # the plain-PyTorch reference per expert: its activations quantized per token
            # by formats.quantize_per_token, the integer sums exact in float64
            def expert(e, x):
                view = {name: t[e * rows : (e + 1) * rows] for name, t in qw.tensors().items()}
                return formats.reference_linear(
                    x, dataclasses.replace(qw, **view, out_features=rows)
                )

            return expert
        return lambda e, x: ops.linear_quantw(
            x, qw.kind, *cut(qw, e, rows)[:2], cut(qw, e, rows)[2], qw.group_size, None
        )

    a, b = stacks["w13"], stacks["w2"]
    for tokens, ids in [
        (7, torch.stack([torch.randperm(num_experts)[:top] for _ in range(7)])),
        (3, torch.tensor([[4, 1]] * 3)),  # experts 1 and 4 take every token, the rest none
        (1, torch.tensor([[5, 0]])),
    ]:
        x = torch.randn(tokens, hidden)
        weights = torch.rand(tokens, top)
        got = ops.moe_quantw(
            x, weights, ids, num_experts, a.kind, a.group_size,
            a.weight, a.scale, a.zero, b.weight, b.scale, b.zero,
        )  # fmt: skip
        # routed_experts' loop with the op's own SiLU: torch's SiLU kernel differs by ISA
        # (on an AVX512 Xeon by enough ulps to move an output 2e-4 relatively through the
        # down product, and under int8_w8a8 one ulp can tip one of h's roundings to int8),
        # so the comparison would hang on the CPU rather than on the routing
        want = _loop_with_op_silu(
            ops, x, weights, ids, linear("w13", 2 * inter), linear("w2", hidden)
        )
        # the same products, SiLU and sums
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    empty = ops.moe_quantw(
        x[:0], weights[:0], ids[:0], num_experts, a.kind, a.group_size,
        a.weight, a.scale, a.zero, b.weight, b.scale, b.zero,
    )  # fmt: skip
    assert empty.shape == (0, hidden)
    with pytest.raises(RuntimeError, match="picks expert 3 twice"):
        ops.moe_quantw(
            x, weights, torch.tensor([[3, 3]]), num_experts, a.kind, a.group_size,
            a.weight, a.scale, a.zero, b.weight, b.scale, b.zero,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="out of"):
        ops.moe_quantw(
            x, weights, torch.tensor([[0, num_experts]]), num_experts, a.kind, a.group_size,
            a.weight, a.scale, a.zero, b.weight, b.scale, b.zero,
        )  # fmt: skip
