"""Structured output, tool calls and prompt scoring through the server, with the real
`openai` client (and `langchain-openai` for tools); outputs are checked by parsing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import openai
import pytest
import torch

from minivllm.entrypoints.openai.errors import APIError
from minivllm.entrypoints.openai.protocol import ChatCompletionRequest
from minivllm.entrypoints.openai.tool_calls import parse_hermes, plan_tools
from tests.server_utils import MODEL, RemoteServer
from tests.test_structured_output import PERSON, check_person

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 5}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
HI = [{"role": "user", "content": "hello"}]


def check_weather(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"}
    assert args["city"] in ("Paris", "Oslo") and args["unit"] in ("c", "f")


def test_response_format_json_schema(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=HI,
        max_tokens=96,
        temperature=1.0,
        seed=5,
        n=4,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    )
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        check_person(json.loads(choice.message.content))


def test_vllm_guided_fields_on_completions(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL,
        prompt="a b",
        max_tokens=16,
        n=6,
        temperature=1.0,
        seed=2,
        extra_body={"guided_choice": ["left", "right"]},
    )
    assert {c.text for c in out.choices} <= {"left", "right"}
    out = client.completions.create(
        model=MODEL,
        prompt="a b",
        max_tokens=16,
        extra_body={"structured_outputs": {"regex": "[0-9]{4}"}},
    )
    assert re.fullmatch("[0-9]{4}", out.choices[0].text)


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"guided_regex": "[a-"}, "could not be compiled"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "one output constraint"),
        ({"guided_choice": []}, "choice"),
        ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "xgrammar"),
        ({"structured_outputs": {"jsn": {}}}, "unknown keys"),
    ],
)
def test_bad_constraints_are_400(client: openai.OpenAI, extra: dict, field: str) -> None:
    with pytest.raises(openai.BadRequestError, match=field):
        client.completions.create(model=MODEL, prompt="a", max_tokens=4, extra_body=extra)


def test_named_tool_choice_returns_a_call_with_valid_arguments(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=HI,
        max_tokens=64,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    message = out.choices[0].message
    assert message.content is None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    check_weather(call.function.arguments)


def test_required_tool_choice_calls_the_tools_it_names(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=HI,
        max_tokens=160,
        temperature=1.0,
        seed=9,
        n=4,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    for choice in out.choices:
        if choice.finish_reason == "length":
            continue
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        if call.function.name == "get_weather":
            check_weather(call.function.arguments)
        else:
            assert call.function.name == "get_time"
            assert len(json.loads(call.function.arguments)["zone"]) <= 5


def test_streamed_tool_call_arrives_whole(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=HI,
        max_tokens=64,
        stream=True,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    calls = [c for chunk in stream for ch in chunk.choices for c in (ch.delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    check_weather(calls[0].function.arguments)


def test_tool_results_go_back_through_the_template(client: openai.OpenAI) -> None:
    """A second turn with the assistant's call and the tool's answer is accepted."""
    messages = [
        *HI,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Oslo","unit":"c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "3 degrees"},
    ]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, tools=[WEATHER], tool_choice="none"
    )
    assert out.choices[0].message.tool_calls is None


def test_auto_tool_choice_needs_a_parser() -> None:
    """A server without --enable-auto-tool-choice refuses "auto" (vLLM does so too)."""
    request = ChatCompletionRequest.model_validate({"messages": HI, "tools": [WEATHER]})
    with pytest.raises(APIError, match="enable-auto-tool-choice") as info:
        plan_tools(request, parser=None)
    assert info.value.status == 400
    assert plan_tools(request, parser="hermes").mode == "auto"


def test_auto_tool_choice_with_the_hermes_parser(client: openai.OpenAI) -> None:
    """The random model writes no call: its reply comes back as content."""
    out = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=8, tools=[WEATHER])
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason in ("stop", "length")


def test_hermes_parser() -> None:
    text = 'ok <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call> then <tool_call>{"name": "g", "arguments": {}}</tool_call>'
    content, calls = parse_hermes(text)
    assert content == "ok  then"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("f", {"a": 1}),
        ("g", {}),
    ]
    assert parse_hermes("<tool_call>not json</tool_call>") == (
        "<tool_call>not json</tool_call>",
        [],
    )
    assert parse_hermes("plain") == ("plain", [])


def test_langchain_bind_tools(server: RemoteServer) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model=MODEL, base_url=server.url + "/v1", api_key="unused", max_tokens=64, max_retries=0
    )
    reply = chat.bind_tools([WEATHER], tool_choice="get_weather").invoke("weather?")
    assert [c["name"] for c in reply.tool_calls] == ["get_weather"]
    check_weather(json.dumps(reply.tool_calls[0]["args"]))


def test_echo_with_max_tokens_zero_scores_the_prompt(
    client: openai.OpenAI, qwen3_dir: Path, tokenizer
) -> None:
    prompt = "the cat sat on the mat"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text == prompt and out.usage.completion_tokens == 0
    ids = tokenizer(prompt).input_ids
    assert len(choice.logprobs.token_logprobs) == len(ids)
    assert choice.logprobs.token_logprobs[0] is None
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    expected = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)
