"""Routed MoE experts stored quantized in checkpoints (quantization/checkpoint_moe.py's
CheckpointMoEMethod), and quantized experts served by the weight cache and split by
tensor parallelism.

DeepSeek's fp8 layout is written here as its releases store it; compressed-tensors
checkpoints are built with the library itself (tests/compressed_tensors_utils.py). The
oracle is transformers' DeepseekV32ForCausalLM holding the dequantized weights, as in
tests/test_moe_quantization.py, whose fixtures and helpers this file shares.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minivllm import LLM, SamplingParams
from minivllm.quantization.kernel_limits import kernel_supports
from tests.conftest import QUANTIZED_FP32_TOL, assert_logprobs_match
from tests.test_deepseek_v32 import build_dsa_checkpoint
from tests.test_moe_quantization import (
    ENGINE,
    GROUPS,
    PARAMS,
    PROMPTS,
    _activation_group,
    _oracle,
    _quantized_experts_forward,
)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, tokenizer_dir) -> Path:
    return build_dsa_checkpoint(tmp_path_factory.mktemp("moe-ckpt"), tokenizer_dir)


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


@pytest.mark.skipif(not kernel_supports("fp8_w8a16"), reason="CPU lacks AVX512-BF16")
def test_deepseek_fp8_experts_in_one_bf16_call(tmp_path, tokenizer_dir) -> None:
    """DeepSeek's fp8 layout with 64 x 64 blocks in a bf16 engine: the routed experts run
    on the bf16 kernels' block-scaled fp8 in one call a layer (moe_quant.cpp), within bf16
    rounding of the routing loop on the plain-PyTorch reference per expert. (Every input
    size here is a multiple of 64. Whole-model logprobs are no oracle here: with every
    linear in fp8, a bf16 rounding apart tips this random model's near-tied routers.)"""
    from minivllm.layers.moe import routed_experts
    from minivllm.quantization import formats

    src = build_dsa_checkpoint(
        tmp_path / "src", tokenizer_dir, moe_intermediate_size=64, intermediate_size=128,
        q_lora_rank=64, kv_lora_rank=64,
    )  # fmt: skip
    write_deepseek_fp8(src, tmp_path / "fp8", block=(64, 64))
    llm = LLM(str(tmp_path / "fp8"), **dict(ENGINE, dtype="bfloat16"))
    layer = llm.llm_engine.executor.runner.model.model.layers[1].mlp.experts
    method = layer.quant_method
    assert method.bf16_moe_op is not None and method.stacked["w13"].group_size == 64

    def reference(part: str, rows: int):
        qw = method.stacked[part]

        def expert(e: int, x: torch.Tensor) -> torch.Tensor:
            view = {name: t[e * rows : (e + 1) * rows] for name, t in qw.tensors().items()}
            return formats.reference_linear(x, dataclasses.replace(qw, **view, out_features=rows))

        return expert

    experts, hidden = layer.num_experts, method.stacked["w2"].out_features // layer.num_experts
    inter2 = method.stacked["w13"].out_features // experts
    gen = torch.Generator().manual_seed(0)
    for tokens in (1, 3, 7):
        x = torch.randn(tokens, hidden, generator=gen).bfloat16()
        ids = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(tokens)])
        weights = torch.rand(tokens, 2, generator=gen)
        got = method.apply(layer, x, weights, ids).double()
        want = routed_experts(x, weights, ids, reference("w13", inter2), reference("w2", hidden))
        # each product rounds its float32 sums once to bf16 on both sides: h and y may sit
        # a bf16 ulp apart, 2^-8 of the largest output
        assert (got - want.double()).abs().max() <= 2**-8 * want.double().abs().max()
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == PARAMS.max_tokens for o in outs)
    llm.llm_engine.shutdown()
