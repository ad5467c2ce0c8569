"""Partially pre-quantized compressed-tensors checkpoints (built with the library itself).

Layers the checkpoint stores quantized load as they are; online `targets` reach only the
rest. The oracle is transformers in float32 holding each stored layer's dequantized
weight, computed in float32 straight from the safetensors (q and the bf16 scale
multiply exactly in float32, as in our engine), plus the per-token int8 round trip on
the inputs of int8_w8a8 layers.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from safetensors.torch import load_file

from minivllm import LLM, SamplingParams
from tests.compressed_tensors_utils import (
    FP8_PRESETS,
    dequantize_reference,
    make_compressed_checkpoint,
)
from tests.conftest import QUANTIZED_FP32_TOL, assert_logprobs_match

IGNORE = ["re:.*layers\\.1\\.self_attn.*"]
PROMPTS = [[random.Random(i).randrange(3, 250) for _ in range(7 + 6 * i)] for i in range(2)]


def _engine(path: str, **kwargs) -> LLM:
    return LLM(path, dtype="float32", kv_cache_memory_bytes=4 << 20, max_model_len=128, **kwargs)


def _ours(llm: LLM) -> dict[str, str]:
    """Our module name -> scheme id or "unquantized", for the linear layers."""
    model = llm.llm_engine.executor.runner.model
    out = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and name != "model.embed_tokens":
            spec = getattr(method, "spec", None)
            out[name] = spec.scheme if spec else "unquantized"
    return out


def _expected(layout: dict[str, str]) -> dict[str, str]:
    """The checkpoint's layout in our module names (the fused shards agree here)."""
    fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}
    fused |= {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
    out = {}
    for name, scheme in layout.items():
        parent, _, leaf = name.rpartition(".")
        out[f"{parent}.{fused.get(leaf, leaf)}" if parent else leaf] = scheme
    return out


def _oracle_logprobs(path: str, online: dict[str, tuple] | None = None):
    """transformers float32 with the checkpoint's layers dequantized (and `online`'s
    layers: HF name -> QuantWeights-producing (scheme, group, symmetric) fake-quantized)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from minivllm.quantization import formats

    qcfg = json.load(open(os.path.join(path, "config.json")))["quantization_config"]
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors = {k: v.float() if k.endswith("weight_scale") else v for k, v in tensors.items()}
    config = AutoConfig.from_pretrained(path)
    del config.quantization_config
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    group = next(iter(qcfg["config_groups"].values()))
    # int8 activations are rounded per token; fp8 ones (FP8 presets) run unquantized
    w8a8 = (group.get("input_activations") or {}).get("type") == "int"
    # int4 W4A8 runs as int4_w4a8: activations rounded per token and weight group
    act_group = group["weights"]["group_size"] if group["weights"]["num_bits"] == 4 else None
    state = {}
    for name, module in hf.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        weight = dequantize_reference(tensors, name, qcfg).float()
        if online and name in online:
            scheme, group, symmetric = online[name]
            weight = formats.dequantize(formats.quantize(weight, scheme, group, symmetric))
        state[name + ".weight"] = weight
        if w8a8 and name + ".weight_scale" in tensors:
            module.register_forward_pre_hook(
                lambda _m, args: (_per_token_round_trip(args[0], act_group),)
            )
    state |= {
        k: v.float()
        for k, v in tensors.items()
        if "weight_" not in k and not k.endswith("input_scale") and k not in state
    }
    hf.load_state_dict(state, strict=True)
    return hf


def _per_token_round_trip(x: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """x rounded to int8 per token (per token and group of `group` k) and back."""
    groups = x if group is None else x.unflatten(-1, (-1, group))
    amax = groups.abs().amax(-1, keepdim=True)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / 127)
    if group is None:
        return torch.clamp(torch.round(groups / scale), -127, 127) * scale
    # int4_w4a8 rounds x * (127 / amax), one fp32 division then a product
    inv = torch.where(amax == 0, torch.ones_like(amax), torch.full_like(amax, 127) / amax)
    return (torch.clamp(torch.round(groups * inv), -127, 127) * scale).flatten(-2)


def _compare(llm: LLM, hf) -> None:
    params = SamplingParams(
        temperature=0, max_tokens=5, ignore_eos=True, logprobs=1, prompt_logprobs=1
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert_logprobs_match(hf, PROMPTS, outputs, tol=QUANTIZED_FP32_TOL)


@pytest.mark.parametrize(
    ("scheme", "options"),
    [
        ("int8_w8a16", {}),
        ("int8_w8a8", {}),
        ("int4_w4a16", {}),
        ("int4_w4a16", {"asymmetric": True}),
        ("int4_w4a8", {}),
        ("int4_w4a8", {"asymmetric": True}),
        ("fp8_w8a16", {}),
        ("fp8_dynamic", {}),
        ("fp8_static", {}),
        ("fp8_block", {}),
    ],
)
def test_stored_layers_load_as_stored(tmp_path, scheme, options) -> None:
    """Each scheme against transformers holding the dequantized weights. llm-compressor's
    FP8 presets (fp8 activations, per token or static; FP8's weight scales per tensor, so
    the fused q/k/v and gate/up layers hold one scale per shard) run as fp8_w8a16."""
    path = str(tmp_path / "ckpt")
    layout = make_compressed_checkpoint(path, scheme, IGNORE, **options)
    llm = _engine(path)
    ours = _ours(llm)
    assert ours == _expected(layout)
    assert ours["model.layers.1.self_attn.qkv_proj"] == "unquantized"
    assert ours["model.layers.0.mlp.down_proj"] == FP8_PRESETS.get(scheme, scheme)
    qkv = llm.llm_engine.executor.runner.model.model.layers[0].self_attn.qkv_proj
    if scheme == "fp8_static":  # one scale per shard: q, k and v differ
        assert len(set(qkv.quant_method.quant_weights.scale.tolist())) == 3
    if scheme == "fp8_block":  # a scale per row and group of k
        assert qkv.quant_method.quant_weights.scale.shape == (256, 2)
    _compare(llm, _oracle_logprobs(path))


def test_online_targets_reach_only_the_layers_the_checkpoint_left_unquantized(
    tmp_path, caplog
) -> None:
    path = str(tmp_path / "ckpt")
    make_compressed_checkpoint(path, "int4_w4a16", IGNORE)
    with caplog.at_level("INFO", logger="minivllm"):
        llm = _engine(path, quantization="int8")
    ours = _ours(llm)
    assert ours["model.layers.0.self_attn.qkv_proj"] == "int4_w4a16"  # stored
    assert ours["model.layers.1.self_attn.qkv_proj"] == "int8_w8a16"  # online
    assert ours["model.layers.1.self_attn.o_proj"] == "int8_w8a16"
    assert ours["lm_head"] == "unquantized"
    assert "from the checkpoint, pack-quantized" in caplog.text
    assert "quantized 2 layers as int8_w8a16 (from target '*')" in caplog.text
    online = {
        f"model.layers.1.self_attn.{p}": ("int8_w8a16", 128, True)
        for p in ("q_proj", "k_proj", "v_proj", "o_proj")
    }
    _compare(llm, _oracle_logprobs(path, online))


def test_unsupported_checkpoint_quantization_is_refused(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    make_compressed_checkpoint(path, "int8_w8a16", [])
    config = json.load(open(os.path.join(path, "config.json")))
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ValueError, match="does not load"):
        _engine(path)
    config["quantization_config"]["format"] = "sparse-24-bitmask"
    config["quantization_config"]["config_groups"]["group_0"]["format"] = "sparse-24-bitmask"
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ValueError, match="'sparse-24-bitmask' format"):
        _engine(path)
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ValueError, match="'gptq' are not supported"):
        _engine(path)
