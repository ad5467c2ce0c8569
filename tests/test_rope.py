"""Rotary embeddings and max_model_len derivation against transformers."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.config import derive_max_model_len
from minivllm.layers.rotary import compute_inv_freq
from tests.conftest import hf_greedy

HEAD_DIM = 16
ROPE_CASES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "beta_fast": 16,
        "beta_slow": 2,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "longrope": {
        "rope_type": "longrope",
        "original_max_position_embeddings": 512,
        "short_factor": [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)],
        "long_factor": [2.0 + 0.3 * i for i in range(HEAD_DIM // 2)],
    },
}


def _llama_config(rope: dict):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_scaling=dict(rope),
        rope_theta=10000.0,
    )


@pytest.mark.parametrize("name", sorted(ROPE_CASES))
def test_inverse_frequencies_match_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _llama_config(ROPE_CASES[name])
    params = config.rope_parameters
    ours, scale, dim = compute_inv_freq(params, HEAD_DIM, 512, max_model_len=256)
    rope_type = params["rope_type"]
    if rope_type == "default":
        ref = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
        ref_scale = 1.0
    else:
        ref, ref_scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=256)
    assert dim == HEAD_DIM
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale)


@pytest.mark.parametrize("name", ["linear", "yarn-mscale", "llama3", "longrope"])
def test_scaled_rope_models_match_transformers(make_checkpoint, name):
    model_dir = make_checkpoint("LlamaForCausalLM", rope_scaling=ROPE_CASES[name])
    prompts = [[5, 9, 30, 200, 41, 7] * 8, [11, 12, 13]]
    expected = hf_greedy(model_dir, prompts, max_new_tokens=8)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory_bytes=4 << 20, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == expected


def test_max_model_len_is_never_multiplied_by_the_rope_factor():
    config = _llama_config(ROPE_CASES["yarn"])
    assert derive_max_model_len(config, None) == 512
    assert derive_max_model_len(config, 300) == 300
    with pytest.raises(ValueError, match="larger than the model's maximum of 512"):
        derive_max_model_len(config, 2048)


def test_sliding_window_matches_transformers(make_checkpoint):
    model_dir = make_checkpoint("MistralForCausalLM", sliding_window=8)
    prompts = [[5, 9, 30, 200, 41, 7, 99, 3, 8, 17, 23, 310, 44, 2, 71, 6] * 2]
    expected = hf_greedy(model_dir, prompts, max_new_tokens=10)
    for budget in (None, 5):  # whole prompt at once, and chunked (reads the window from the cache)
        llm = LLM(
            str(model_dir),
            dtype="float32",
            kv_cache_memory_bytes=4 << 20,
            max_model_len=128,
            max_num_batched_tokens=budget,
            enable_prefix_caching=False,
        )
        got = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
            use_tqdm=False,
        )
        assert [o.outputs[0].token_ids for o in got] == expected
