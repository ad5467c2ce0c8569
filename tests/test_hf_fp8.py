"""Checkpoints in transformers' fp8 format (`quant_method: "fp8"`, Qwen's and DeepSeek's
official FP8 releases): block scales `weight_scale_inv`, or one `weight_scale` per tensor.

The checkpoints are written here as that format stores them (block amax / 448, e4m3
saturating); the oracle for block-scaled ones is transformers itself loading the file
(`FineGrainedFP8Config(dequantize=True)`: its own reading of the format), for per-tensor
ones transformers holding the weights dequantized by hand.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from minivllm import LLM, SamplingParams
from tests.conftest import QUANTIZED_FP32_TOL, assert_logprobs_match

KEEP = ["model.layers.1.self_attn"]  # modules_to_not_convert: substrings of module names
PROMPTS = [[random.Random(i).randrange(3, 400) for _ in range(7 + 6 * i)] for i in range(2)]


def _fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)


def write_hf_fp8(src: Path, out: Path, block: tuple[int, int] | None) -> dict[str, torch.Tensor]:
    """`src` (an fp32 checkpoint) in transformers' fp8 format; returns the dequantized
    weight of each converted linear, by module name."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    state, dequantized = {}, {}
    for name, module in hf.named_modules():
        if not isinstance(module, torch.nn.Linear) or name == "lm_head":
            continue
        if any(keep in name for keep in KEEP):
            continue
        w = module.weight.detach()
        if block is None:
            scale = (w.abs().amax() / 448).reshape(1)
            full = scale
            state[f"{name}.weight_scale"] = scale
        else:
            rows, cols = block
            blocks = w.abs().unflatten(0, (-1, rows)).unflatten(-1, (-1, cols)).amax(dim=(1, 3))
            scale = blocks / 448
            full = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
            state[f"{name}.weight_scale_inv"] = scale.contiguous()
        state[f"{name}.weight"] = _fp8(w, full)
        dequantized[name] = state[f"{name}.weight"].to(torch.float32) * full
    for name, tensor in hf.state_dict().items():
        if name not in state and not (hf.config.tie_word_embeddings and name == "lm_head.weight"):
            state[name] = tensor.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = hf.config.to_dict()
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block) if block else None,
        "modules_to_not_convert": KEEP,
    }
    (out / "config.json").write_text(json.dumps(config))
    for f in os.listdir(src):  # the tokenizer's files
        if not (out / f).exists() and "safetensors" not in f:
            shutil.copy(os.path.join(src, f), out / f)
    return dequantized


def _layout(llm: LLM) -> dict[str, str]:
    """Our linear layers' schemes by module name ("unquantized" for full precision)."""
    model = llm.llm_engine.executor.runner.model
    layout = {}
    for name, module in model.named_modules():
        if name.endswith(("_proj", "lm_head")):
            spec = getattr(module.quant_method, "spec", None)
            layout[name] = spec.scheme if spec is not None else "unquantized"
    return layout


def _generate(llm: LLM) -> list:
    params = SamplingParams(
        temperature=0, max_tokens=5, ignore_eos=True, logprobs=1, prompt_logprobs=1
    )
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_block_scaled_fp8_matches_transformers_loading_it(make_checkpoint, tmp_path, cpu_kernels):
    """Block-scaled fp8 (32 x 32 blocks: the tiny model's sizes; real ones are 128 x 128)
    runs as fp8_w8a16 with a scale per row and group of k, on the AVX2 kernel and the
    reference; layer 1's attention (modules_to_not_convert) and the LM head stay fp32."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    out = tmp_path / "fp8"
    write_hf_fp8(make_checkpoint("Qwen3ForCausalLM"), out, (32, 32))
    llm = LLM(
        str(out),
        dtype="float32",
        kv_cache_memory_bytes=4 << 20,
        max_model_len=128,
        cpu_kernels=cpu_kernels,
    )
    layout = _layout(llm)
    assert layout["model.layers.0.self_attn.qkv_proj"] == "fp8_w8a16"
    assert layout["model.layers.0.mlp.down_proj"] == "fp8_w8a16"
    assert layout["model.layers.1.self_attn.qkv_proj"] == "unquantized"
    assert layout["model.layers.1.mlp.gate_up_proj"] == "fp8_w8a16"
    qkv = llm.llm_engine.executor.runner.model.model.layers[0].self_attn.qkv_proj
    weights = qkv.quant_method.quant_weights
    assert weights.group_size == 32 and weights.scale.shape == (qkv.output_size, 2)
    hf = AutoModelForCausalLM.from_pretrained(
        out, quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32
    ).eval()
    assert_logprobs_match(hf, PROMPTS, _generate(llm), tol=QUANTIZED_FP32_TOL)


def test_per_tensor_fp8(make_checkpoint, tmp_path):
    """fp8 without blocks (vLLM's Fp8Config checkpoints): one `weight_scale` per tensor, the
    fused q/k/v and gate/up layers keeping each shard's."""
    from transformers import AutoModelForCausalLM

    src = make_checkpoint("Qwen3ForCausalLM")
    out = tmp_path / "fp8"
    dequantized = write_hf_fp8(src, out, None)
    llm = LLM(str(out), dtype="float32", kv_cache_memory_bytes=4 << 20, max_model_len=128)
    qkv = llm.llm_engine.executor.runner.model.model.layers[0].self_attn.qkv_proj
    assert len(set(qkv.quant_method.quant_weights.scale.tolist())) == 3
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, weight in dequantized.items():
            hf.get_submodule(name).weight.copy_(weight)
    assert_logprobs_match(hf, PROMPTS, _generate(llm), tol=QUANTIZED_FP32_TOL)


def test_unsupported_fp8_checkpoints_are_refused(make_checkpoint, tmp_path):
    out = tmp_path / "fp8"
    write_hf_fp8(make_checkpoint("Qwen3ForCausalLM"), out, (32, 32))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["fmt"] = "e5m2"
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'e5m2' are not supported"):
        LLM(str(out), dtype="float32", max_model_len=64)
    config["quantization_config"] |= {"fmt": "e4m3", "weight_block_size": [32, 24]}
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="block_structure"):
        LLM(str(out), dtype="float32", max_model_len=64)
