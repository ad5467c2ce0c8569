"""Bad input gets a clear error, and the engine keeps serving everything else."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from minivllm import LLM, SamplingParams
from tests.conftest import hf_greedy

BAD_PARAMS = [
    ({"n": 0}, "n"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logit_bias": {1: 1000.0}}, "logit_bias"),
    ({"temperature": float("nan")}, "temperature"),
    ({"seed": 1.5}, "seed"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"n": True}, "n"),
]


@pytest.mark.parametrize("kwargs,field", BAD_PARAMS, ids=[f for _, f in BAD_PARAMS])
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises((ValueError, TypeError), match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_are_rejected_and_others_still_served(qwen3_llm):
    engine = qwen3_llm.llm_engine
    good = {"prompt_token_ids": [5, 6, 7, 8]}
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = qwen3_llm.generate([good], params, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("inflight", good, params)
    engine.step()
    bad_cases = [
        ("", ValueError, "empty"),
        ({"prompt_token_ids": []}, ValueError, "empty"),
        ({"prompt_token_ids": [1, 99999]}, ValueError, "out of vocabulary"),
        ({"prompt_token_ids": [1, -4]}, ValueError, "out of vocabulary"),
        ({"prompt_token_ids": [1] * 300}, ValueError, "maximum model length 256"),
        ({"prompt_token_ids": ["a"]}, TypeError, "integers"),
        (42, TypeError, "prompt"),
    ]
    for prompt, exc, match in bad_cases:
        with pytest.raises(exc, match=match):
            engine.add_request(None, prompt, params)
    with pytest.raises(ValueError, match="out of vocabulary"):
        engine.add_request(None, good, SamplingParams(stop_token_ids=[10**6]))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("inflight", good, params)
    with pytest.raises(ValueError, match="one per prompt"):
        qwen3_llm.generate([good, good], [params], use_tqdm=False)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step()})
    assert outputs["inflight"].outputs[0].token_ids == expected
    engine.kv_cache_manager.pool.check_integrity()


def test_unknown_engine_argument_is_named(qwen3_dir):
    with pytest.raises(TypeError, match="gpu_memory_utilisation"):
        LLM(str(qwen3_dir), gpu_memory_utilisation=0.5)


def test_max_model_len_above_the_model_is_refused(qwen3_dir):
    with pytest.raises(ValueError, match="larger than the model's maximum"):
        LLM(str(qwen3_dir), max_model_len=100_000)


def test_unknown_architecture_lists_supported(qwen3_dir, tmp_path):
    model_dir = tmp_path / "m"
    shutil.copytree(qwen3_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="not supported.*Qwen3ForCausalLM"):
        LLM(str(model_dir))


def test_missing_and_unexpected_weights_are_named(qwen3_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    weights = load_file(qwen3_dir / "model.safetensors")
    for name, mutate in [
        ("missing", lambda w: w.pop("model.layers.1.mlp.up_proj.weight")),
        ("unexpected", lambda w: w.update({"model.layers.0.extra.weight": torch.zeros(2)})),
    ]:
        model_dir = tmp_path / name
        shutil.copytree(qwen3_dir, model_dir)
        changed = dict(weights)
        mutate(changed)
        save_file(changed, model_dir / "model.safetensors")
        match = (
            "model.layers.1.mlp.up_proj.weight"
            if name == "missing"
            else "model.layers.0.extra.weight"
        )
        with pytest.raises(ValueError, match=match):
            LLM(str(model_dir), kv_cache_memory_bytes=4 << 20, max_model_len=64)


def test_sharded_checkpoint_loads(make_checkpoint):
    model_dir = make_checkpoint("LlamaForCausalLM", max_shard_size="100KB", seed=3)
    assert (model_dir / "model.safetensors.index.json").exists()
    assert len(list(model_dir.glob("*.safetensors"))) > 1
    prompts = [[5, 6, 7, 8, 9]]
    expected = hf_greedy(model_dir, prompts, max_new_tokens=6)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory_bytes=4 << 20, max_model_len=64)
    got = llm.generate(
        [{"prompt_token_ids": prompts[0]}],
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        use_tqdm=False,
    )
    assert got[0].outputs[0].token_ids == expected[0]


def test_dtypes(qwen3_dir):
    for dtype, expected in [
        ("bfloat16", torch.bfloat16),
        ("float16", torch.float16),
        ("float32", torch.float32),
    ]:
        llm = LLM(str(qwen3_dir), dtype=dtype, kv_cache_memory_bytes=4 << 20, max_model_len=64)
        model = llm.llm_engine.executor.runner.model
        assert model.lm_head.weight.dtype == expected
        out = llm.generate(["hello"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) >= 1
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(qwen3_dir), dtype="int8")


def test_too_small_kv_budget_says_what_to_do(qwen3_dir):
    with pytest.raises(ValueError, match="raise kv_cache_memory_bytes"):
        LLM(str(qwen3_dir), kv_cache_memory_bytes=1024, max_model_len=256)


def test_auto_dtype_takes_the_checkpoint_dtype(make_checkpoint, caplog):
    import logging

    from minivllm.kernels.isa import cpu_has_avx512_bf16

    # without AVX512-BF16 a bf16 checkpoint runs in float32 on the AVX2 kernels (config.resolve_dtype)
    bf16_runs_as = torch.bfloat16 if cpu_has_avx512_bf16() else torch.float32
    bf16_dir = make_checkpoint("Qwen3ForCausalLM", dtype=torch.bfloat16, seed=4)
    llm = LLM(str(bf16_dir), kv_cache_memory_bytes=4 << 20, max_model_len=64)
    assert llm.llm_engine.config.model.dtype == bf16_runs_as
    fp16_dir = make_checkpoint("Qwen3ForCausalLM", dtype=torch.float16, seed=4)
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        llm = LLM(str(fp16_dir), kv_cache_memory_bytes=4 << 20, max_model_len=64, device="cpu")
    assert llm.llm_engine.config.model.dtype == bf16_runs_as
    assert "float16 checkpoint on CPU" in caplog.text
