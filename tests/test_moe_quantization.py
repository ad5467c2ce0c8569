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

import json
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
    # fp32 engines on the AVX2 family run a layer's experts in one call (avx2_moe.cpp),
    # but int8_w8a8, which rounds its activations in Python first
    one_call = bool(cpu_flags() >= {"avx2", "fma", "f16c"})
    one_call = one_call and layer.quant_method.spec.scheme != "int8_w8a8"
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


@pytest.mark.parametrize("source", ["online int4", "fp8 checkpoint"])
def test_weight_cache_maps_quantized_experts(moe_dir, tmp_path, source) -> None:
    """A daemon holding quantized experts (online int4, or the fp8 checkpoint's as
    stored) serves a mapping engine, which runs them as a disk-loading engine does."""
    from tests.test_weight_cache import mapping_of
    from tests.weight_cache_harness import Daemon, assert_same_outputs, short_dir

    quant = dict(quantization="int4", quantization_config=GROUPS)
    args = ["--quantization", "int4", "--quantization-config", json.dumps(GROUPS)]
    if source == "fp8 checkpoint":
        write_deepseek_fp8(moe_dir, tmp_path / "fp8")
        moe_dir, quant, args = tmp_path / "fp8", {}, []
    engine = dict(dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=8 << 20)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    disk = LLM(str(moe_dir), **engine, **quant)
    expected = disk.generate(prompts, greedy, use_tqdm=False)
    disk.llm_engine.shutdown()
    socket_dir = short_dir()
    daemon = Daemon(moe_dir, socket_dir, tmp_path / "daemon.log", *args)
    try:
        daemon.wait_ready()
        extra = {"socket_dir": str(socket_dir), "fallback": False}
        llm = LLM(
            str(moe_dir),
            load_format="ipc_cache",
            model_loader_extra_config=extra,
            **engine,
            **quant,
        )
        assert_same_outputs(llm.generate(prompts, greedy, use_tqdm=False), expected)
        layer = llm.llm_engine.executor.runner.model.model.layers[1].mlp.experts
        assert layer.w13_weight.dtype == torch.uint8  # int4 nibbles, or fp8 bytes
        assert "memfd:minivllm-weights" in mapping_of(layer.w2_weight.data_ptr())[1]
        assert layer.quant_method.source == ("fp8" if quant == {} else "online")
        llm.llm_engine.shutdown()
    finally:
        daemon.stop()


# ------------------------------------------------------------- pre-quantized experts
_LINEARS = (
    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "wk", "wq_b",
    "gate_proj", "up_proj", "down_proj",
)  # fmt: skip


def _block_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, block scales [ceil(N / rows), ceil(K / cols)]) as DeepSeek's fp8
    releases store a weight: each block's amax / 448, values saturated to +-448."""
    rows, cols = block
    n, k = w.shape
    padded = F.pad(w.abs(), (0, -k % cols, 0, -n % rows))
    scale = padded.unflatten(0, (-1, rows)).unflatten(-1, (-1, cols)).amax(dim=(1, 3)) / 448
    full = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:n, :k]
    return (w / full).clamp(-448, 448).to(torch.float8_e4m3fn), scale.contiguous()


def write_deepseek_fp8(src: Path, out: Path, block=(32, 32)) -> dict[str, torch.Tensor]:
    """`src` as DeepSeek's official fp8 checkpoints are laid out (transformers' fp8 format:
    every linear, routed experts included, e4m3 with `weight_scale_inv` block scales; the
    router, the indexer's weights_proj, norms, embeddings and the LM head as they were).
    Returns each converted weight dequantized, by checkpoint module name."""
    import shutil

    from safetensors.torch import load_file, save_file

    state = load_file(src / "model.safetensors")
    dequantized = {}
    for name in list(state):
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or module.rsplit(".", 1)[-1] not in _LINEARS:
            continue
        q, scale = _block_fp8(state[name], block)
        state[name], state[f"{module}.weight_scale_inv"] = q, scale
        rows, cols = block
        full = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
        dequantized[module] = q.float() * full[: q.shape[0], : q.shape[1]]
    out.mkdir(parents=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    (out / "config.json").write_text(json.dumps(config))
    for f in src.iterdir():
        if not (out / f.name).exists() and "safetensors" not in f.name:
            shutil.copy(f, out / f.name)
    return dequantized


def _hf_holding(model_dir: Path, weights: dict[str, torch.Tensor]):
    """transformers' float32 model of `model_dir`'s unquantized twin holding `weights`
    (checkpoint module name -> weight), the routed experts' stacked from theirs."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    modules = dict(hf.named_modules())
    with torch.no_grad():
        for name, w in weights.items():
            owner, _, proj = name.rpartition(".")
            if owner.rsplit(".", 1)[0].endswith("mlp.experts"):
                experts, e = owner.rsplit(".", 1)
                stacks = modules[experts]
                inter = stacks.down_proj.shape[-1]
                if proj == "down_proj":
                    stacks.down_proj[int(e)].copy_(w)
                else:
                    rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
                    stacks.gate_up_proj[int(e), rows].copy_(w)
            else:
                modules[name].weight.copy_(w)
    return hf


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_deepseek_fp8_checkpoint_loads_its_experts_as_stored(
    moe_dir, tmp_path, cpu_kernels, caplog
) -> None:
    """DeepSeek's fp8 release layout: the routed experts run as fp8_w8a16 with their block
    scales (a scale per row and group of k), on the AVX2 kernel and on the reference;
    logprobs match transformers holding the dequantized weights."""
    out = tmp_path / "fp8"
    dequantized = write_deepseek_fp8(moe_dir, out)
    with caplog.at_level(logging.INFO, logger="minivllm"):
        llm = LLM(str(out), **ENGINE, cpu_kernels=cpu_kernels)
    assert "mlp.experts: 2" in caplog.text and "a scale per 32x32 block" in caplog.text
    layer = llm.llm_engine.executor.runner.model.model.layers[1].mlp.experts
    assert type(layer.quant_method).__name__ == "CheckpointMoEMethod"
    qw = layer.quant_method.experts["w2"][0].quant_weights
    assert qw.scheme == "fp8_w8a16" and qw.group_size == 32 and qw.scale.shape == (64, 1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    hf = _hf_holding(moe_dir, dequantized)
    assert_logprobs_match(hf, PROMPTS, outputs, tol=QUANTIZED_FP32_TOL)


def test_online_targets_leave_stored_experts_alone(moe_dir, tmp_path) -> None:
    """`--quantization int8` on an fp8 checkpoint reaches only the layers it left
    unquantized: its stored experts stay fp8, never re-quantized."""
    out = tmp_path / "fp8"
    write_deepseek_fp8(moe_dir, out)
    llm = LLM(str(out), **ENGINE, quantization="int8")
    layer = llm.llm_engine.executor.runner.model.model.layers[1].mlp.experts
    assert layer.quant_method.spec.scheme == "fp8_w8a16"
    assert type(layer.quant_method).__name__ == "CheckpointMoEMethod"


def test_missing_or_misshapen_expert_scales_are_errors(moe_dir, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    out = tmp_path / "fp8"
    write_deepseek_fp8(moe_dir, out)
    path = out / "model.safetensors"
    state = load_file(path)
    name = "model.layers.2.mlp.experts.5.up_proj.weight_scale_inv"
    scale = state.pop(name)
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(
        ValueError,
        match=r"lacks routed-expert tensors: model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight_scale_inv$",
    ):
        LLM(str(out), **ENGINE)
    state[name] = scale[:, :1].contiguous()
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"experts\.5\.up_proj\.weight_scale_inv: block scales .* \[1, 2\]"
    ):
        LLM(str(out), **ENGINE)


@pytest.fixture(scope="module")
def wide_moe_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """Expert intermediate size 64 (the dense MLPs' 128): 32 (64) per rank at
    tensor_parallel_size 2, which 32-k groups and 32 x 32 blocks divide."""
    out = tmp_path_factory.mktemp("moe-quant-wide")
    return build_dsa_checkpoint(out, tokenizer_dir, moe_intermediate_size=64, intermediate_size=128)


@pytest.mark.parametrize("source", ["online int4", "fp8 checkpoint", "ct int4 asymmetric"])
def test_tensor_parallel_2_splits_quantized_experts(wide_moe_dir, tmp_path, source) -> None:
    """Each rank holds its slice of every expert's intermediate dimension: gate and up
    rows, down's k columns with their scale groups. Groups and blocks fall within a
    rank's slice, so the ranks hold exactly the single-rank quantization's numbers and
    transformers with the dequantized weights is the oracle."""
    if source == "fp8 checkpoint":
        model_dir = tmp_path / "fp8"
        weights = write_deepseek_fp8(wide_moe_dir, model_dir)
        quant = {}
    elif source == "ct int4 asymmetric":  # zero points packed down the rows, cut per rank
        from tests.compressed_tensors_utils import compress_routed_experts

        model_dir = tmp_path / "ct"
        weights = compress_routed_experts(wide_moe_dir, model_dir, "int4_w4a16", asymmetric=True)
        quant = {}
    else:
        model_dir, weights = wide_moe_dir, None
        quant = dict(quantization="int4", quantization_config=GROUPS)
    llm = LLM(str(model_dir), tensor_parallel_size=2, **ENGINE, **quant)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    if weights is None:  # the single-rank engine's quantization, as the oracle holds it
        single = LLM(str(model_dir), **ENGINE, **quant)
        hf = _oracle(model_dir, single)
        single.llm_engine.shutdown()
    else:
        hf = _hf_holding(wide_moe_dir, weights)
    assert_logprobs_match(hf, PROMPTS, outputs, tol=QUANTIZED_FP32_TOL)


@pytest.mark.parametrize(
    ("scheme", "options"),
    [
        ("int8_w8a16", {}),  # pack-quantized, 8 bits
        ("int4_w4a16", {}),  # pack-quantized groups
        ("int4_w4a16", {"asymmetric": True}),  # zero points packed down the rows
        ("int8_w8a8", {}),  # int-quantized, dynamic int8 activations
        ("int4_w4a8", {"asymmetric": True}),  # int-quantized int4, zero points unpacked
        ("int4_w4a8", {}),
        ("fp8_w8a16", {}),  # per channel
        ("fp8_static", {}),  # per tensor, static activation scales (read, unused)
        ("fp8_block", {}),  # block scales [48, 32]: partial row blocks
    ],
)
def test_compressed_tensors_experts_load_as_stored(moe_dir, tmp_path, scheme, options) -> None:
    """Routed experts a compressed-tensors checkpoint stores quantized (built with the
    library itself) run as stored; the oracle is transformers holding them dequantized by
    the library-free reader that tests/compressed_tensors_utils.py checks against the
    library, each expert input rounded to int8 where the scheme does."""
    from tests.compressed_tensors_utils import FP8_PRESETS, compress_routed_experts

    out = tmp_path / "ct"
    dequantized = compress_routed_experts(moe_dir, out, scheme, **options)
    llm = LLM(str(out), **ENGINE)
    layer = llm.llm_engine.executor.runner.model.model.layers[2].mlp.experts
    method = layer.quant_method
    assert type(method).__name__ == "CheckpointMoEMethod"
    assert method.spec.scheme == FP8_PRESETS.get(scheme, scheme)
    assert method.spec.symmetric == (not options.get("asymmetric", False))
    dense = llm.llm_engine.executor.runner.model.model.layers[0].mlp.gate_up_proj
    assert type(dense.quant_method).__name__ == "UnquantizedLinearMethod"  # not targeted
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    hf = _hf_holding(moe_dir, dequantized)
    group = _activation_group(method.spec)
    tol = QUANTIZED_FP32_TOL
    if group is not None:
        for name, module in hf.named_modules():
            if name.endswith("mlp.experts"):
                module.forward = types.MethodType(_quantized_experts_forward(group), module)
        # an expert input a hair from an int8 rounding boundary rounds either way under
        # the two sides' summation orders (the reference backend lands where the kernel
        # does: 5.6e-4 off for asymmetric int4_w4a8 here); one flipped step moves a
        # logprob by ~1e-3 at most in this model, a wrong scale or zero point by > 1e-2
        tol = 2 * QUANTIZED_FP32_TOL
    assert_logprobs_match(hf, PROMPTS, outputs, tol=tol)


@needs_avx2
@pytest.mark.parametrize(
    ("scheme", "group", "symmetric"),
    [
        ("int8_w8a16", 0, True),
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
    from minivllm.layers.moe import routed_experts

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
        want = routed_experts(x, weights, ids, linear("w13", 2 * inter), linear("w2", hidden))
        # the same products and sums; only SiLU differs (the AVX2 silu_and_mul's exp
        # against torch's), by a few ulps of each activation
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


def test_checkpoint_patterns_match_as_each_would_alone() -> None:
    """compressed-tensors / fp8 ignore lists go through one compiled matcher
    (compressed_tensors._matcher); every name matches as the patterns' own re.match or
    exact comparison says, backreferences and inline flags included."""
    import re

    from minivllm.quantization.compressed_tensors import _matches_any

    patterns = (
        "re:model\\.layers\\.(1)\\.mlp\\.experts\\.\\1\\.",  # a backreference
        "re:(?i)MODEL\\.norm",  # an inline flag, which must not spread
        "re:.*self_attn\\.o_proj$",
        "model.layers.0.mlp.experts.3.up_proj",
    )

    def alone(name: str) -> bool:
        return any(
            re.match(p[3:], name) is not None if p.startswith("re:") else p == name
            for p in patterns
        )

    names = [
        "model.layers.1.mlp.experts.1.down_proj",
        "model.layers.1.mlp.experts.2.down_proj",
        "model.norm",
        "MODEL.LAYERS.0.MLP.EXPERTS.3.UP_PROJ",  # (?i) stays with its own pattern
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.self_attn.o_proj.x",
        "model.layers.0.mlp.experts.3.up_proj",
        "model.layers.0.mlp.experts.3.up_proj2",
    ]
    got = [_matches_any(patterns, n) for n in names]
    assert got == [alone(n) for n in names] == [True, False, True, False, True, False, True, False]
    with pytest.raises(ValueError, match="not a valid regex"):
        _matches_any(("re:a)|(?:b",), "b")
