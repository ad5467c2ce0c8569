"""Structured output (xgrammar) and prompt scoring: outputs are checked by parsing them
independently (json, re, the schema's own rules), scores against transformers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.sampling_params import StructuredOutputsParams
from tests.test_engine import small_block_bytes

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "colour": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "colour", "ok"],
    "additionalProperties": False,
}


def check_person(value: object) -> None:
    """PERSON's rules, checked without xgrammar."""
    assert isinstance(value, dict) and set(value) == {"name", "colour", "ok"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 6
    assert value["colour"] in ("red", "green", "blue")
    assert isinstance(value["ok"], bool)


@pytest.fixture(scope="module")
def llm(qwen3_dir: Path) -> LLM:
    return LLM(str(qwen3_dir), dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=256)


def generate(llm: LLM, constraint: StructuredOutputsParams, n: int = 8, **kwargs) -> list:
    kwargs = {"temperature": 1.0, "seed": 1, "max_tokens": 96, **kwargs}
    params = SamplingParams(n=n, structured_outputs=constraint, **kwargs)
    (out,) = llm.generate(["a b c"], params, use_tqdm=False)
    return out.outputs


def test_json_schema_outputs_parse_and_follow_the_schema(llm: LLM) -> None:
    outputs = generate(llm, StructuredOutputsParams(json=PERSON))
    for c in outputs:
        assert c.finish_reason == "stop", c.text
        check_person(json.loads(c.text))
    # sampled, not forced to one answer: the random model's choices differ between samples
    assert len({c.text for c in outputs}) > 1


def test_unconstrained_output_of_the_same_model_is_not_json(llm: LLM) -> None:
    """The random model says nothing parseable by itself: the grammar did the work above."""
    (out,) = llm.generate(
        ["a b c"], SamplingParams(temperature=1.0, seed=1, max_tokens=32), use_tqdm=False
    )
    with pytest.raises(ValueError):
        check_person(json.loads(out.outputs[0].text))


def test_regex_choice_json_object_and_grammar(llm: LLM) -> None:
    for c in generate(llm, StructuredOutputsParams(regex=r"[a-c]{3}-[0-9]{2}")):
        assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", c.text), c.text
    choices = ["yes", "no", "maybe so"]
    picked = {c.text for c in generate(llm, StructuredOutputsParams(choice=choices), n=16)}
    assert picked <= set(choices) and len(picked) > 1
    for c in generate(llm, StructuredOutputsParams(json_object=True)):
        if c.finish_reason == "stop":  # an object may be long; what ended must parse
            assert isinstance(json.loads(c.text), dict)
    ebnf = 'root ::= "(" digit ("," digit)* ")"\ndigit ::= [0-9]'
    for c in generate(llm, StructuredOutputsParams(grammar=ebnf)):
        if c.finish_reason == "stop":
            assert re.fullmatch(r"\([0-9](,[0-9])*\)", c.text), c.text


def test_greedy_constrained_output_is_the_best_allowed_token_each_step(
    llm: LLM, qwen3_dir: Path
) -> None:
    """Second code path: transformers' logits masked to the allowed choice prefixes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3_dir)
    choices = ["alpha", "beta", "gamma"]
    params = SamplingParams(
        temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(choice=choices)
    )
    prompt = tok("x y z").input_ids
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()
    ids, text = list(prompt), ""
    while text not in choices:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        allowed = [
            t
            for t in range(len(tok))
            if any(c.startswith(text + tok.decode([t])) for c in choices) and tok.decode([t])
        ]
        best = max(allowed, key=lambda t: logits[t].item())
        ids.append(best)
        text += tok.decode([best])
    assert out.outputs[0].text == text


def test_constraints_survive_preemption(llm: LLM, qwen3_dir: Path) -> None:
    """A preempted request's matcher is rebuilt from its tokens: greedy constrained outputs
    with preemption equal those of an engine that never preempts."""
    params = SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=PERSON)
    )
    prompts = [f"{w} b c d e f g h i j k l" for w in "abcdef"]
    expected = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    small = LLM(
        str(qwen3_dir),
        dtype="float32",
        block_size=8,
        max_model_len=64,
        kv_cache_memory_bytes=12 * small_block_bytes(qwen3_dir, 8),
    )
    got = [o.outputs[0].text for o in small.generate(prompts, params, use_tqdm=False)]
    assert small.llm_engine.stats().num_preemptions > 0
    assert got == expected


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(json={"type": "object"}, regex="a"), "exactly one"),
        (dict(), "exactly one"),
        (dict(json="{not json"), "not valid JSON"),
        (dict(choice=[]), "choice"),
        (dict(regex=""), "non-empty"),
    ],
)
def test_bad_constraints_are_value_errors(kwargs: dict, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        StructuredOutputsParams(**kwargs)


def test_uncompilable_constraints_are_refused_before_the_engine(llm: LLM) -> None:
    for constraint in (
        StructuredOutputsParams(regex="[a-"),
        StructuredOutputsParams(json={"type": "no-such-type"}),
        StructuredOutputsParams(grammar="root ::= undefined_rule"),
    ):
        with pytest.raises(ValueError, match="could not be compiled"):
            llm.generate(["a"], SamplingParams(structured_outputs=constraint), use_tqdm=False)
    # the engine still serves after the refusals
    assert llm.generate(["a"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs
