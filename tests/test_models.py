"""Model numerics against HF transformers on tiny random checkpoints."""

from __future__ import annotations

import random

import pytest

from minivllm import LLM, SamplingParams
from tests.conftest import assert_logprobs_match, hf_greedy


def _prompts(n: int, vocab: int = 500, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


@pytest.mark.parametrize(
    "arch", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
)
def test_greedy_matches_transformers(make_checkpoint, arch):
    model_dir = make_checkpoint(arch)
    prompts = _prompts(5)
    expected = hf_greedy(model_dir, prompts, max_new_tokens=12)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory_bytes=4 << 20, max_model_len=128)
    params = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, logprobs=1, prompt_logprobs=1
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    _check_logprobs_against_transformers(model_dir, prompts, outputs)


def _check_logprobs_against_transformers(model_dir, prompts, outputs) -> None:
    """Every prompt and sampled token's logprob within 1e-4 of transformers' log-softmax."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert_logprobs_match(hf, prompts, outputs)
