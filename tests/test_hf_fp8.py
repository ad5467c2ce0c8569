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
from minivllm.quantization.kernel_limits import kernel_supports
from tests.conftest import (
    QUANTIZED_FP32_TOL,
    assert_logprobs_match,
    assert_prompt_logprobs_close,
)

KEEP = ["model.layers.1.self_attn"]  # modules_to_not_convert: substrings of module names
PROMPTS = [[random.Random(i).randrange(3, 400) for _ in range(7 + 6 * i)] for i in range(2)]


def _fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)


def write_hf_fp8(
    src: Path, out: Path, block: tuple[int, int] | None, per_tensor_name: str = "weight_scale"
) -> dict[str, torch.Tensor]:
    """`src` (an fp32 checkpoint) in transformers' fp8 format; returns the dequantized
    weight of each converted linear, by module name. Per-tensor scales are named
    `per_tensor_name` ("weight_scale" as vLLM writes them, a [1] tensor; "weight_scale_inv"
    as transformers does, 0-d)."""
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
            stored = scale if per_tensor_name == "weight_scale" else scale.reshape(())
            state[f"{name}.{per_tensor_name}"] = stored
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


def test_per_tensor_fp8_as_transformers_saves_it(make_checkpoint, tmp_path):
    """transformers' own per-tensor fp8 files name the scale `weight_scale_inv` (0-d): the
    same scales load, and the logprobs follow transformers loading the file."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    out = tmp_path / "fp8"
    write_hf_fp8(make_checkpoint("Qwen3ForCausalLM"), out, None, "weight_scale_inv")
    llm = LLM(str(out), dtype="float32", kv_cache_memory_bytes=4 << 20, max_model_len=128)
    qkv = llm.llm_engine.executor.runner.model.model.layers[0].self_attn.qkv_proj
    assert len(set(qkv.quant_method.quant_weights.scale.tolist())) == 3
    hf = AutoModelForCausalLM.from_pretrained(
        out, quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32
    ).eval()
    assert_logprobs_match(hf, PROMPTS, _generate(llm), tol=QUANTIZED_FP32_TOL)


def test_a_missing_fp8_scale_is_an_error(make_checkpoint, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "fp8"
    write_hf_fp8(make_checkpoint("Qwen3ForCausalLM"), out, None)
    tensors = load_file(out / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.weight_scale"]
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="holds no weight_scale"):
        LLM(str(out), dtype="float32", max_model_len=64)


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
    with pytest.raises(ValueError, match=r"weight_block_size: fp8 blocks \[32, 24\]"):
        LLM(str(out), dtype="float32", max_model_len=64)


LAYERS = {  # class, constructor arguments, the checkpoint shards (shard id, rows)
    "qkv": ("QKVParallelLinear", (64, 16, 4, 1), [("q", 64), ("k", 16), ("v", 16)]),
    "merged": ("MergedColumnParallelLinear", (64, [80, 80]), [(0, 80), (1, 80)]),
    "column": ("ColumnParallelLinear", (64, 80), [(None, 80)]),
    "row": ("RowParallelLinear", (128, 80), [(None, 80)]),
    "replicated": ("ReplicatedLinear", (64, 80, False), [(None, 80)]),
}


@pytest.mark.parametrize("layer_kind", list(LAYERS))
@pytest.mark.parametrize("block", [(48, 32), None])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_scales_reach_every_layer_kind(monkeypatch, layer_kind, block, tp_size):
    """Per-tensor and block scales (48-row blocks: partial ones at the bottom of every
    shard) loaded into each linear kind on each rank: the rank's dequantized weight is what
    the same layer, unquantized, holds after loading the dequantized checkpoint tensor."""
    from minivllm.kernels.registry import TORCH
    from minivllm.layers import linear
    from minivllm.quantization import ct_method, formats
    from minivllm.quantization.config import SchemeSpec

    cls_name, args, shards = LAYERS[layer_kind]
    cls = getattr(linear, cls_name)
    gen = torch.Generator().manual_seed(3)
    k = args[0]
    checkpoint = []
    for shard_id, rows in shards:
        w = torch.randn(rows, k, generator=gen)
        if block is None:
            scale = (w.abs().amax() / 448).reshape(1)
            full = scale
        else:
            r, c = block
            padded = torch.nn.functional.pad(w.abs(), (0, -k % c, 0, -rows % r))
            scale = padded.unflatten(0, (-1, r)).unflatten(-1, (-1, c)).amax(dim=(1, 3)) / 448
            full = scale.repeat_interleave(r, 0).repeat_interleave(c, 1)[:rows, :k]
        q = _fp8(w, full)
        checkpoint.append((shard_id, q, scale, q.float() * full))
    name = "weight_scale" if block is None else "weight_scale_inv"
    for rank in range(tp_size):
        for module in (linear, ct_method):
            monkeypatch.setattr(module, "get_tp_size", lambda: tp_size)
        monkeypatch.setattr(linear, "get_tp_rank", lambda r=rank: r)
        method = ct_method.CompressedTensorsLinearMethod(
            SchemeSpec("fp8_w8a16"), None, "fp8", block is None, block, name
        )
        layer = cls(*args, quant_method=method)
        plain = cls(*args)
        for shard_id, q, scale, dequantized in checkpoint:
            layer.weight.weight_loader(layer.weight, q, shard_id)
            getattr(layer, name).weight_loader(getattr(layer, name), scale, shard_id)
            plain.weight.weight_loader(plain.weight, dequantized, shard_id)
        method.process_weights_after_loading(layer, TORCH)
        assert torch.equal(formats.dequantize(method.quant_weights), plain.weight.data), rank


def test_wrong_block_scales_are_refused(make_checkpoint, tmp_path):
    """Block scales with a row count other than ceil(N / rows) do not load silently."""
    from safetensors.torch import load_file

    out = tmp_path / "fp8"
    write_hf_fp8(make_checkpoint("Qwen3ForCausalLM"), out, (32, 32))
    tensors = load_file(out / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    tensors[name] = torch.cat([tensors[name], tensors[name]])
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"checkpoint tensor '{name}': block scales"):
        LLM(str(out), dtype="float32", max_model_len=64)


def test_modules_to_not_convert_match_as_transformers_does():
    """transformers' own matcher is the oracle: a key as a regex from the start of the name
    up to a module boundary, or as a suffix."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    from minivllm.quantization.hf_fp8 import read_fp8_checkpoint

    keys = ["model.layers.1", "mlp.gate", "model.layers.*.self_attn.o_proj", "fc1"]
    quant = read_fp8_checkpoint({"quant_method": "fp8", "modules_to_not_convert": keys})
    names = [
        f"model.layers.{i}.{m}"
        for i in (1, 2, 11)
        for m in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate", "mlp.gate_proj", "fc1")
    ]
    for name in names:
        assert (quant.spec_for(name, []) is None) == (not should_convert_module(name, keys)), name
    assert quant.spec_for("lm_head", []) is None


def test_quantized_routed_experts_are_refused(tmp_path):
    """An MoE checkpoint whose routed experts are stored in fp8 (DeepSeek's releases) is
    refused by name, never cast to the model's dtype without its scales."""
    from safetensors.torch import load_file

    from minivllm.loader.hub import resolve_model_path

    src = Path(resolve_model_path("demo-sparse"))
    shutil.copytree(src, tmp_path / "ckpt")
    (weights,) = list((tmp_path / "ckpt").glob("*.safetensors"))
    tensors = load_file(weights)
    name = next(n for n in tensors if ".experts.0.gate_proj.weight" in n)
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="quantized routed experts"):
        LLM(str(tmp_path / "ckpt"), dtype="float32", max_model_len=64)


@pytest.mark.skipif(not kernel_supports("fp8_w8a16"), reason="CPU lacks AVX512-BF16")
def test_block_scaled_fp8_on_the_bf16_kernels(make_checkpoint, tmp_path):
    """In a bf16 engine, blocks of 64 k run on the bf16 kernel (quant_linear's grouped
    fp8); its logprobs stay within bf16 rounding of the plain-PyTorch reference's (the
    dense test's bound, test_quantization.py)."""
    out = tmp_path / "fp8"
    write_hf_fp8(make_checkpoint("Qwen3ForCausalLM"), out, (64, 64))
    runs = {}
    for backend in ("cpu_kernel", "torch"):
        llm = LLM(
            str(out),
            dtype="bfloat16",
            kv_cache_memory_bytes=4 << 20,
            max_model_len=128,
            kernel_config={"linear_backend_per_quant": {"fp8_w8a16": backend}},
        )
        method = llm.llm_engine.executor.runner.model.model.layers[0].mlp.down_proj.quant_method
        assert method.quant_weights.group_size == 64
        kernel = (
            "torch" if backend == "torch" else "cpu_kernel (quant_linear, bfloat16 activations)"
        )
        assert method.op_name.startswith(kernel), method.op_name
        runs[backend] = _generate(llm)
        llm.llm_engine.shutdown()
    assert_prompt_logprobs_close(runs["cpu_kernel"], runs["torch"])
