"""The bundled demo checkpoints load and generate in transformers and in minivllm."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

DEMO_DIR = Path(__file__).resolve().parents[1] / "minivllm" / "demo_models"
MODEL_NAMES = ["demo-base", "demo-draft", "demo-sparse"]
PROMPTS = ["The for statement in Python", "A dictionary is", "This module provides"]
EOS_TOKEN_ID, IM_START_TOKEN_ID, IM_END_TOKEN_ID = 0, 1, 2
CHECKPOINT_FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "README.md",
]


@cache
def load_model(name: str) -> PreTrainedModel:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(DEMO_DIR / name, dtype=torch.float32).eval()


@cache
def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(DEMO_DIR / name)


def hf_greedy(name: str, prompt: str, max_new_tokens: int) -> list[int]:
    """Token ids transformers generates greedily after ``prompt`` (prompt excluded)."""
    input_ids = load_tokenizer(name)(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        output = load_model(name).generate(
            input_ids, max_new_tokens=max_new_tokens, do_sample=False
        )
    return output[0, input_ids.shape[1] :].tolist()


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_checkpoint_is_complete(name: str) -> None:
    for filename in CHECKPOINT_FILES:
        assert (DEMO_DIR / name / filename).is_file(), filename
    generation = json.loads((DEMO_DIR / name / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [EOS_TOKEN_ID, IM_END_TOKEN_ID]
    assert "Held-out loss" in (DEMO_DIR / name / "README.md").read_text()


def test_demo_models_are_small() -> None:
    total = sum(path.stat().st_size for path in DEMO_DIR.glob("*/*"))
    assert total < 40e6


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_tokenizer_special_tokens_and_chat_template(name: str) -> None:
    tokenizer = load_tokenizer(name)
    assert len(tokenizer) == 4096
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        EOS_TOKEN_ID,
        IM_START_TOKEN_ID,
        IM_END_TOKEN_ID,
    ]
    chat = [{"role": "user", "content": "What is a list?"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is a list?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(tokenizer("x = [1, 2]\n    pass").input_ids) == "x = [1, 2]\n    pass"


def test_models_share_one_tokenizer() -> None:
    files = {(DEMO_DIR / name / "tokenizer.json").read_bytes() for name in MODEL_NAMES}
    assert len(files) == 1


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_greedy_generation_produces_text(name: str) -> None:
    tokenizer = load_tokenizer(name)
    for prompt in PROMPTS:
        new_ids = hf_greedy(name, prompt, max_new_tokens=12)
        assert new_ids
        assert str(tokenizer.decode(new_ids, skip_special_tokens=True)).strip()


def test_sparse_indexer_selects_top_k_keys() -> None:
    """Positions with at most index_topk causal keys attend densely; later ones sparsely."""
    model = load_model("demo-sparse")
    topk = model.config.index_topk
    assert topk == 64
    input_ids = load_tokenizer("demo-sparse")(
        " ".join(["The os module provides functions."] * 30)
    ).input_ids
    input_ids = torch.tensor([input_ids[: 2 * topk]])
    with torch.no_grad():
        sparse = model(input_ids=input_ids).logits
        for layer in model.model.layers:
            layer.self_attn.indexer.index_topk = 4 * topk
        try:
            dense = model(input_ids=input_ids).logits
        finally:
            for layer in model.model.layers:
                layer.self_attn.indexer.index_topk = topk
    assert sparse.shape == (1, 2 * topk, 4096)
    assert torch.isfinite(sparse).all()
    torch.testing.assert_close(sparse[:, :topk], dense[:, :topk])
    assert not torch.allclose(sparse[:, topk:], dense[:, topk:])


# demo-sparse also gets a prompt longer than its index_topk (64): the selection matters there
LONG_PROMPT = (
    "The os module provides a portable way of using operating system dependent functionality. "
    "If you just want to read or write a file see open, if you want to manipulate paths, see "
    "the os.path module, and if you want to read all the lines in all the files on the command "
    "line see the fileinput module."
)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_minivllm_greedy_matches_transformers(name: str) -> None:
    """minivllm's greedy tokens equal transformers' token for token (float32); models load by name."""
    from minivllm import LLM, SamplingParams

    prompts = PROMPTS + ([LONG_PROMPT] if name == "demo-sparse" else [])
    if name == "demo-sparse":
        assert len(load_tokenizer(name)(LONG_PROMPT).input_ids) > 64
    llm = LLM(name, dtype="float32", kv_cache_memory_bytes=64 << 20)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert len(outputs) == len(prompts)
    for prompt, output in zip(prompts, outputs):
        expected = hf_greedy(name, prompt, max_new_tokens=20)
        assert list(output.outputs[0].token_ids) == expected
        text = load_tokenizer(name).decode(expected, skip_special_tokens=True)
        assert output.outputs[0].text == text
