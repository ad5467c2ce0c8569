"""vLLM's scale-out routes (`--enable-scale-out`) end to end: render -> generate ->
derender gives what the ordinary route gives, and every field is bounded."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.server_utils import (
    MAX_MODEL_LEN,
    MODEL,
    PROMPTS,
    RemoteServer,
    assert_error,
    post,
    tiny_server_args,
)

GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
DERENDER_TOKEN_LIMIT = 2048  # --max-tokens-per-request: also bounds what one derender decodes
HI = [{"role": "user", "content": "Say hello"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def server(qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    log = tmp_path_factory.mktemp("scale-out") / "server.log"
    args = tiny_server_args(
        "--enable-scale-out",
        "--max-tokens-per-request",
        str(DERENDER_TOKEN_LIMIT),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    )
    remote = RemoteServer(qwen3_dir, args, log)
    try:
        yield remote.wait_ready()
    finally:
        status = remote.stop()
    assert status == 0, remote.log()[-4000:]
    assert "Traceback" not in remote.log(), remote.log()[-4000:]


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def ok(server: RemoteServer, path: str, body: Any) -> Any:
    response = post(server, path, body)
    assert response.status_code == 200, response.text[:2000]
    return response.json()


def generate(server: RemoteServer, rendered: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return ok(server, "/inference/v1/generate", {**rendered, **changes})


# ---------------------------------------------------------------- round trips


def test_chat_round_trip_equals_chat(
    server: RemoteServer, client: openai.OpenAI, tokenizer: Any
) -> None:
    chat_request = {"model": MODEL, "messages": HI, "logprobs": True, "top_logprobs": 2, **GREEDY}
    rendered = ok(server, "/v1/chat/completions/render", chat_request)
    assert rendered["request_id"].startswith("chatcmpl-") and rendered["output_mode"] == "tokens"
    template_ids = tokenizer.apply_chat_template(
        HI, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert rendered["token_ids"] == list(template_ids)
    params = rendered["sampling_params"]
    assert params["max_tokens"] == 12 and params["temperature"] == 0.0 and params["logprobs"] == 2

    answer = generate(server, rendered)
    assert set(answer) >= {"request_id", "model", "created", "usage", "prompt_token_ids", "choices"}
    assert answer["request_id"] == f"generate-tokens-{rendered['request_id']}"
    (choice,) = answer["choices"]
    assert len(choice["token_ids"]) == 12 and choice["finish_reason"] == "length"
    first = choice["logprobs"]["content"][0]
    assert set(first) == {"token_id", "logprob", "rank", "top_logprobs"}
    assert first["token_id"] == choice["token_ids"][0] == first["top_logprobs"][0]["token_id"]

    derendered = ok(
        server,
        "/v1/chat/completions/derender",
        {
            "generate_response": answer,
            "prompt_tokens": len(rendered["token_ids"]),
            "prompt_token_ids": rendered["token_ids"],
            "chat_request": chat_request,
        },
    )
    direct = client.chat.completions.create(
        messages=HI,
        model=MODEL,
        logprobs=True,
        top_logprobs=2,
        temperature=0.0,
        max_tokens=12,
        extra_body={"ignore_eos": True},
    )
    assert derendered["object"] == "chat.completion" and derendered["model"] == MODEL
    (got,) = derendered["choices"]
    want = direct.choices[0]
    assert got["message"] == {"role": "assistant", "content": want.message.content}
    assert got["finish_reason"] == want.finish_reason
    assert derendered["usage"] == direct.usage.model_dump(exclude_none=True)
    got_lp, want_lp = got["logprobs"]["content"], want.logprobs.content
    assert [e["token"] for e in got_lp] == [e.token for e in want_lp]
    assert [[t["token"] for t in e["top_logprobs"]] for e in got_lp] == [
        [t.token for t in e.top_logprobs] for e in want_lp
    ]
    assert [e["logprob"] for e in got_lp] == pytest.approx([e.logprob for e in want_lp], abs=1e-4)


def test_completion_round_trip_equals_completion(
    server: RemoteServer, client: openai.OpenAI
) -> None:
    """Two prompts render to two GenerateRequests; derender numbers the choices across them."""
    request = {"model": MODEL, "prompt": PROMPTS[:2], "logprobs": 1, **GREEDY}
    rendered = ok(server, "/v1/completions/render", request)
    assert [r["request_id"][:5] for r in rendered] == ["cmpl-", "cmpl-"]
    answers = [generate(server, r) for r in rendered]
    derendered = ok(
        server,
        "/v1/completions/derender",
        {
            "generate_responses": answers,
            "prompt_tokens": [len(r["token_ids"]) for r in rendered],
            "completion_request": request,
        },
    )
    direct = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[:2],
        logprobs=1,
        temperature=0.0,
        max_tokens=12,
        extra_body={"ignore_eos": True},
    )
    assert derendered["object"] == "text_completion"
    want = sorted(direct.choices, key=lambda c: c.index)
    assert [c["index"] for c in derendered["choices"]] == [0, 1]
    assert [c["text"] for c in derendered["choices"]] == [c.text for c in want]
    assert [c["logprobs"]["tokens"] for c in derendered["choices"]] == [
        c.logprobs.tokens for c in want
    ]
    assert [c["logprobs"]["text_offset"] for c in derendered["choices"]] == [
        c.logprobs.text_offset for c in want
    ]
    assert derendered["usage"] == direct.usage.model_dump(exclude_none=True)


def test_logit_bias_round_trip(server: RemoteServer, client: openai.OpenAI, tokenizer: Any) -> None:
    """Render writes logit_bias with string keys (JSON); generate takes it as it is, and
    answers what the ordinary route answers."""
    request = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0.0}
    direct = client.completions.create(**request, logit_bias={"42": 100})
    (rendered,) = ok(server, "/v1/completions/render", {**request, "logit_bias": {"42": 100}})
    answer = generate(server, rendered)
    assert answer["choices"][0]["token_ids"] == [42] * 6
    assert direct.choices[0].text == tokenizer.decode([42] * 6)


def test_stop_string_round_trip(server: RemoteServer, client: openai.OpenAI) -> None:
    """A stop string ends generation and is cut from the derendered text, as in /v1/completions."""
    full = client.completions.create(
        model=MODEL, prompt=PROMPTS[2], temperature=0.0, max_tokens=12
    ).choices[0]
    stop = full.text[len(full.text) // 2 :][:2]
    request = {"model": MODEL, "prompt": PROMPTS[2], "temperature": 0.0, "max_tokens": 12}
    direct = client.completions.create(**request, stop=[stop]).choices[0]
    (rendered,) = ok(server, "/v1/completions/render", {**request, "stop": [stop]})
    answer = generate(server, rendered)
    derendered = ok(
        server,
        "/v1/completions/derender",
        {"generate_responses": [answer], "completion_request": {**request, "stop": [stop]}},
    )
    (got,) = derendered["choices"]
    assert (got["text"], got["finish_reason"], got["stop_reason"]) == (
        direct.text,
        direct.finish_reason,
        direct.model_extra["stop_reason"],
    )
    assert direct.finish_reason == "stop" and stop not in got["text"]


def test_named_tool_call_round_trip(server: RemoteServer, client: openai.OpenAI) -> None:
    """Render carries the tool's schema as structured_outputs; derender reads the call back."""
    tool_choice = {"type": "function", "function": {"name": "get_weather"}}
    request = {
        "model": MODEL,
        "messages": HI,
        "tools": [WEATHER],
        "tool_choice": tool_choice,
        "temperature": 0.0,
        "max_tokens": 64,
    }
    rendered = ok(server, "/v1/chat/completions/render", request)
    assert (
        rendered["sampling_params"]["structured_outputs"]["json"]
        == WEATHER["function"]["parameters"]
    )
    answer = generate(server, rendered)
    body = {"generate_response": answer, "chat_request": request}
    (got,) = ok(server, "/v1/chat/completions/derender", body)["choices"]
    want = client.chat.completions.create(**request).choices[0]
    assert got["finish_reason"] == want.finish_reason == "stop"
    assert got["message"]["content"] is None and len(got["message"]["tool_calls"]) == 1
    call = got["message"]["tool_calls"][0]["function"]
    assert call == want.message.tool_calls[0].function.model_dump()
    assert set(json.loads(call["arguments"])) == {"city", "unit"}


def test_derender_reads_hermes_tool_calls(server: RemoteServer, tokenizer: Any) -> None:
    """With the server's --tool-call-parser, "auto" calls in the output become tool_calls."""
    text = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}</tool_call>'
    )
    answer = {"choices": [{"index": 0, "token_ids": tokenizer(text).input_ids}]}
    chat_request = {"model": MODEL, "messages": HI, "tools": [WEATHER]}
    body = {"generate_response": answer, "chat_request": chat_request, "prompt_tokens": 7}
    derendered = ok(server, "/v1/chat/completions/derender", body)
    (choice,) = derendered["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo", "unit": "c"}
    assert derendered["usage"]["prompt_tokens"] == 7
    plain = ok(server, "/v1/chat/completions/derender", {"generate_response": answer})
    assert plain["choices"][0]["message"]["content"] == text  # no request: plain text


# ---------------------------------------------------------------- generate


def test_generate_text_mode_equals_completion(server: RemoteServer, client: openai.OpenAI) -> None:
    (rendered,) = ok(server, "/v1/completions/render", {"prompt": PROMPTS[0], **GREEDY})
    answer = generate(server, rendered, output_mode="text", return_token_ids=True)
    direct = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        temperature=0.0,
        max_tokens=12,
        extra_body={"ignore_eos": True},
    )
    (choice,) = answer["choices"]
    assert answer["output_mode"] == "text" and choice["text"] == direct.choices[0].text
    assert answer["prompt_token_ids"] == rendered["token_ids"]
    assert answer["usage"] == direct.usage.model_dump(exclude_none=True)


@pytest.mark.parametrize("output_mode", ["tokens", "text"])
def test_generate_stream_equals_whole(
    server: RemoteServer, tokenizer: Any, output_mode: str
) -> None:
    """Minimal request (vLLM's example), streamed: the chunks add up to the whole answer."""
    token_ids = tokenizer(PROMPTS[1]).input_ids
    body = {
        "token_ids": token_ids,
        "output_mode": output_mode,
        "sampling_params": {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "logprobs": 0},
    }
    whole = ok(server, "/inference/v1/generate", body)
    streamed = {
        **body,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    response = post(server, "/inference/v1/generate", streamed)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["prompt_token_ids"] == token_ids
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert all(c["output_mode"] == output_mode for c in chunks)
    *token_chunks, final = chunks
    assert final["choices"] == [] and final["usage"] == whole["usage"]
    deltas = [c["choices"][0] for c in token_chunks]
    (want,) = whole["choices"]
    assert [t for d in deltas for t in d["token_ids"]] == want["token_ids"]
    assert deltas[-1]["finish_reason"] == want["finish_reason"] == "length"
    assert [c["usage"]["completion_tokens"] for c in token_chunks] == list(range(1, 9))
    assert [e for d in deltas for e in d["logprobs"]["content"]] == want["logprobs"]["content"]
    if output_mode == "text":
        assert "".join(d["text"] for d in deltas) == want["text"] != ""
        assert set(want["logprobs"]["content"][0]) == {"token", "logprob", "bytes", "top_logprobs"}


# ---------------------------------------------------------------- validation

TOKENS = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}}


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({**TOKENS, "token_ids": []}, 400, "token_ids"),
        ({**TOKENS, "token_ids": [1, -1]}, 400, "token_ids"),
        ({**TOKENS, "token_ids": [1, 10**6]}, 400, "out of vocabulary"),
        ({**TOKENS, "token_ids": [1] * MAX_MODEL_LEN}, 400, "maximum context length"),
        ({**TOKENS, "sampling_params": {"max_tokens": MAX_MODEL_LEN}}, 400, "max_tokens"),
        ({**TOKENS, "sampling_params": {"n": 0}}, 400, "sampling_params.n"),
        ({**TOKENS, "sampling_params": {"temperature": "0"}}, 400, "temperature"),
        ({**TOKENS, "sampling_params": {"bad_words": ["a"]}}, 400, "bad_words"),
        ({**TOKENS, "sampling_params": {"logprobs": 99}}, 400, "logprobs"),
        (
            {**TOKENS, "sampling_params": {"detokenize": False}, "output_mode": "text"},
            400,
            "detokenize",
        ),
        ({**TOKENS, "output_mode": "derender"}, 400, "output_mode"),
        ({**TOKENS, "cache_salt": "a/b"}, 400, "cache_salt"),
        ({**TOKENS, "cache_salt": "x" * 2000}, 400, "cache_salt"),
        ({**TOKENS, "priority": 1}, 400, "priority"),
        ({**TOKENS, "features": {"mm_hashes": {}}}, 400, "features"),
        ({**TOKENS, "request_id": "a b"}, 400, "request_id"),
        ({**TOKENS, "model": "other"}, 404, "other"),
        ({"token_ids": [1]}, 400, "sampling_params"),
    ],
)
def test_generate_refuses(server: RemoteServer, body: dict, status: int, needle: str) -> None:
    error = assert_error(post(server, "/inference/v1/generate", body), status, needle)
    assert len(error["message"]) <= 1024


def _answer(token_ids: list[int], **choice: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "token_ids": token_ids, **choice}]}


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/v1/chat/completions/derender", {"generate_response": _answer([])}, "empty"),
        ("/v1/chat/completions/derender", {"generate_response": _answer([10**6])}, "vocabulary"),
        (
            "/v1/chat/completions/derender",
            {"generate_response": _answer([1] * (MAX_MODEL_LEN + 1))},
            "max_model_len",
        ),
        (
            "/v1/chat/completions/derender",
            {
                "generate_response": _answer(
                    [5, 6], logprobs={"content": [{"token_id": 5, "logprob": -1.0}]}
                )
            },
            "one entry per token",
        ),
        (
            "/v1/chat/completions/derender",
            {"generate_response": _answer([5], finish_reason="x")},
            "finish_reason",
        ),
        (
            "/v1/chat/completions/derender",
            {"generate_response": _answer([5]), "stream": True},
            "stream",
        ),
        (
            "/v1/completions/derender",
            {"generate_responses": [_answer([5])], "prompt_tokens": [1, 2]},
            "prompt_tokens",
        ),
        ("/v1/completions/derender", {"generate_responses": []}, "generate_responses"),
        (
            "/v1/completions/derender",
            {"generate_responses": [_answer([5] * MAX_MODEL_LEN)] * 9},
            "--max-tokens-per-request",
        ),
        ("/v1/completions/render", {"prompt": "a", "echo": True}, "echo"),
        ("/v1/chat/completions/render", {"messages": []}, "messages"),
    ],
)
def test_render_and_derender_refuse(
    server: RemoteServer, path: str, body: dict, needle: str
) -> None:
    assert_error(post(server, path, body), 400, needle)
