"""End to end: how `minivllm serve` refuses bad requests (OpenAI-style error bodies, bounded sizes)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest

from tests.server_utils import (
    BODY_LIMIT,
    GREEDY,
    MAX_MODEL_LEN,
    MODEL,
    PROMPTS,
    RemoteServer,
    assert_error,
    greedy_text,
    post,
)


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("n", 0, "[1, 128]"),
        ("n", 500, "[1, 128]"),
        ("logprobs", 21, "[0, 20]"),
        ("max_tokens", 0, "max_tokens"),
        ("temperature", -1, "temperature"),
        ("top_p", 1.5, "top_p"),
        ("min_p", 2, "min_p"),
        ("stop", [""], "stop"),
        ("min_tokens", 20, "min_tokens"),
        ("logit_bias", {"abc": 1}, "logit_bias"),
    ],
)
def test_invalid_fields_are_400_and_named(
    server: RemoteServer, field: str, value: Any, needle: str
) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 8, field: value}
    error = assert_error(post(server, "/v1/completions", body), 400, needle)
    assert error["type"] == "invalid_request_error" and error["param"] == field.split("[")[0]


def test_chat_invalid_fields(server: RemoteServer) -> None:
    def chat(**fields: Any) -> httpx.Response:
        return post(
            server,
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **fields},
        )

    assert_error(chat(top_logprobs=30, logprobs=True), 400, "top_logprobs", "[0, 20]")
    assert_error(chat(n=0), 400, "[1, 128]")
    assert_error(chat(max_completion_tokens=0), 400, "max_completion_tokens")
    assert_error(post(server, "/v1/chat/completions", {"messages": []}), 400, "messages")
    bad_role = {"messages": [{"role": "wizard", "content": "x"}]}
    assert_error(post(server, "/v1/chat/completions", bad_role), 400, "role")


def test_prompt_too_long(server: RemoteServer, tokenizer: Any) -> None:
    prompt = "hello world " * 200
    length = len(tokenizer(prompt).input_ids)
    assert length > MAX_MODEL_LEN
    error = assert_error(
        post(server, "/v1/completions", {"prompt": prompt}), 400, str(MAX_MODEL_LEN), str(length)
    )
    assert error["param"] == "prompt"
    fits = "hello world " * 10
    n = len(tokenizer(fits).input_ids)
    response = post(
        server, "/v1/completions", {"prompt": fits, "max_tokens": MAX_MODEL_LEN - n + 1}
    )
    assert_error(response, 400, str(MAX_MODEL_LEN), "max_tokens")
    chat = {"messages": [{"role": "user", "content": prompt}]}
    assert_error(post(server, "/v1/chat/completions", chat), 400, str(MAX_MODEL_LEN))


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert info.value.status_code == 404 and "no-such-model" in info.value.message


def test_openai_client_sees_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", n=0)
    assert info.value.body["param"] == "n"


def test_body_over_limit_is_413(server: RemoteServer) -> None:
    body = json.dumps({"model": MODEL, "prompt": "x" * (BODY_LIMIT + 10)}).encode()
    assert_error(post(server, "/v1/completions", body), 413, str(BODY_LIMIT))


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "hi", "temperature": "x" * 3_000_000},
        {"prompt": "hi", "stop": ["y" * 3_000_000]},
        {"prompt": "hi", "logit_bias": {"k" * 3_000_000: 1}},
        {"prompt": "hi", "model": "m" * 3_000_000},
        {"prompt": [[1, 2, "z" * 3_000_000]]},
        {"prompt": "hi", "user": "u" * 3_000_000},
        {"messages": [{"role": "r" * 3_000_000, "content": "hi"}]},
    ],
    ids=["float", "stop", "logit_bias-key", "model", "token-id", "user", "role"],
)
def test_error_bodies_do_not_grow_with_input(server: RemoteServer, body: dict[str, Any]) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = post(server, path, body)
    assert response.status_code == 400, response.text[:1000]
    assert len(response.content) < 2048, response.content[:1000]
    assert "error" in response.json()


def test_malformed_input_and_unknown_routes(server: RemoteServer) -> None:
    assert_error(post(server, "/v1/completions", b"{not json"), 400, "JSON")
    assert_error(post(server, "/v1/completions", {"prompt": ""}), 400, "prompt")
    assert_error(post(server, "/v1/completions", {"prompt": []}), 400, "prompt")
    assert_error(post(server, "/v1/completions", {"prompt": [10**9]}), 400, "vocabulary")
    assert_error(post(server, "/v1/completions", {"prompt": {"a": 1}}), 400, "prompt")
    assert_error(httpx.get(server.url + "/v1/nothing-here"), 404)


def test_bad_requests_do_not_harm_requests_in_flight(
    server: RemoteServer, client: openai.OpenAI
) -> None:
    expected = greedy_text(client, PROMPTS[1])
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    bad_bodies = [
        b"{",
        {"prompt": "x", "n": -1},
        {"prompt": [10**9]},
        {"prompt": "x" * 5000},
        {"messages": []},
    ]

    async def good() -> str:
        stream = await aclient.completions.create(
            model=MODEL, prompt=PROMPTS[1], stream=True, **GREEDY
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def bad(http: httpx.AsyncClient, body: Any) -> int:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        path = "/v1/chat/completions" if b"messages" in content else "/v1/completions"
        headers = {"content-type": "application/json"}
        return (await http.post(server.url + path, content=content, headers=headers)).status_code

    async def run() -> tuple[list[str], list[int]]:
        async with aclient, httpx.AsyncClient(timeout=60) as http:
            goods = [asyncio.ensure_future(good()) for _ in range(4)]
            codes = await asyncio.gather(*(bad(http, b) for b in bad_bodies * 4))
            return await asyncio.gather(*goods), codes

    texts, codes = asyncio.run(run())
    assert texts == [expected] * 4
    assert set(codes) == {400}
