"""End to end: the real `minivllm serve` in a subprocess, driven with the official `openai` client."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_utils import RemoteServer

MODEL = "tiny-qwen3"
API_KEY = "sk-test-key"
MAX_MODEL_LEN = 256
BODY_LIMIT = 8 << 20
PROMPTS = ["The quick brown fox", "def main():", "import os\nimport sys", "Hello, world"]
GREEDY = {"temperature": 0.0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
# A chat template unlike the tokenizer's, for the --chat-template server.
OTHER_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]: {{ m['content'] }}\n{% endfor %}[assistant]:"
)


@pytest.fixture(scope="module")
def servers(
    qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, RemoteServer]]:
    """The main server, and a short-lived one with --api-key and --chat-template (started together)."""
    logs = tmp_path_factory.mktemp("server-logs")
    common = [
        "--served-model-name",
        MODEL,
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
    ]
    template = logs / "template.jinja"
    template.write_text(OTHER_TEMPLATE)
    main = RemoteServer(
        qwen3_dir,
        [*common, "--kv-cache-memory-bytes", "4MiB", "--max-request-body-bytes", str(BODY_LIMIT)],
        logs / "main.log",
    )
    keyed = RemoteServer(
        qwen3_dir,
        [
            *common,
            "--kv-cache-memory-bytes",
            "1MiB",
            "--api-key",
            API_KEY,
            "--chat-template",
            str(template),
        ],
        logs / "keyed.log",
    )
    started = {"main": main, "keyed": keyed}
    try:
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        statuses = {name: server.stop() for name, server in started.items()}
    assert statuses["main"] == 0, main.log()[-4000:]
    assert "Traceback" not in main.log(), main.log()[-4000:]


@pytest.fixture(scope="module")
def server(servers: dict[str, RemoteServer]) -> RemoteServer:
    return servers["main"]


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(qwen3_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_dir)


def _greedy_text(client: openai.OpenAI, prompt: str) -> str:
    return client.completions.create(model=MODEL, prompt=prompt, **GREEDY).choices[0].text


def _metrics(server: RemoteServer) -> dict[str, float]:
    """Every sample as `name{label="v",...}` -> value (labels sorted, model_name left out)."""
    text = httpx.get(server.url + "/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(
                f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "model_name"
            )
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def _post(server: RemoteServer, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=60, **kwargs)


def _assert_error(response: httpx.Response, status: int, *needles: str) -> dict[str, Any]:
    assert response.status_code == status, response.text[:2000]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for needle in needles:
        assert needle in error["message"], error
    return error


# ---------------------------------------------------------------- routes


def test_models_health_version(server: RemoteServer, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def test_tokenize_detokenize(server: RemoteServer, tokenizer: Any) -> None:
    ids = tokenizer(PROMPTS[2]).input_ids
    body = _post(server, "/tokenize", {"model": MODEL, "prompt": PROMPTS[2]}).json()
    assert (
        body["tokens"] == ids
        and body["count"] == len(ids)
        and body["max_model_len"] == MAX_MODEL_LEN
    )
    assert _post(server, "/detokenize", {"tokens": ids}).json()["prompt"] == PROMPTS[2]
    messages = [{"role": "user", "content": "hi"}]
    chat_ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert _post(server, "/tokenize", {"messages": messages}).json()["tokens"] == list(chat_ids)


# ---------------------------------------------------------------- completions and chat


def test_completion_usage_matches_tokenizer(client: openai.OpenAI, tokenizer: Any) -> None:
    result = client.completions.create(model=MODEL, prompt=PROMPTS[0], **GREEDY)
    choice = result.choices[0]
    assert result.usage.prompt_tokens == len(tokenizer(PROMPTS[0]).input_ids)
    assert result.usage.completion_tokens == 12 and choice.finish_reason == "length"
    assert result.usage.total_tokens == result.usage.prompt_tokens + 12


def test_token_id_prompts_and_batches(client: openai.OpenAI, tokenizer: Any) -> None:
    texts = [_greedy_text(client, p) for p in PROMPTS[:2]]
    ids = [tokenizer(p).input_ids for p in PROMPTS[:2]]
    by_ids = client.completions.create(model=MODEL, prompt=ids[0], **GREEDY)
    assert by_ids.choices[0].text == texts[0]
    batch = client.completions.create(model=MODEL, prompt=PROMPTS[:2], **GREEDY)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == texts
    assert batch.usage.prompt_tokens == sum(map(len, ids))
    batch_ids = client.completions.create(model=MODEL, prompt=ids, **GREEDY)
    assert [c.text for c in sorted(batch_ids.choices, key=lambda c: c.index)] == texts


def test_streaming_equals_non_streaming(client: openai.OpenAI) -> None:
    expected = client.completions.create(model=MODEL, prompt=PROMPTS[1], **GREEDY)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPTS[1],
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == expected.usage.model_dump()
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streaming_and_usage(client: openai.OpenAI, tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    kwargs = {"temperature": 0.0, "max_completion_tokens": 10, "extra_body": {"ignore_eos": True}}
    result = client.chat.completions.create(model=MODEL, messages=messages, **kwargs)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert result.usage.prompt_tokens == len(tokenizer(prompt, add_special_tokens=False).input_ids)
    assert result.usage.completion_tokens == 10
    assert result.choices[0].message.role == "assistant"
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, messages[1]]
    same = client.chat.completions.create(model=MODEL, messages=parts, **kwargs)
    assert same.choices[0].message.content == result.choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        **kwargs,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == result.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10


def test_n_samples_streamed_and_whole(client: openai.OpenAI) -> None:
    kwargs = {
        "model": MODEL,
        "prompt": PROMPTS[3],
        "n": 3,
        "temperature": 1.0,
        "seed": 7,
        "max_tokens": 8,
    }
    whole = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in whole.choices) == [0, 1, 2]
    assert whole.usage.completion_tokens == 24
    assert len({c.text for c in whole.choices}) > 1  # distinct seeds per sample
    streamed: dict[int, str] = {0: "", 1: "", 2: ""}
    for chunk in client.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == {c.index: c.text for c in whole.choices}


def test_seeded_sampling_reproduces(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        kwargs = {"temperature": 1.0, "top_p": 0.9, "seed": seed, "max_tokens": 16}
        return client.completions.create(model=MODEL, prompt=PROMPTS[0], **kwargs).choices[0].text

    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(4321)


def test_completion_logprobs_and_echo(client: openai.OpenAI, tokenizer: Any) -> None:
    result = client.completions.create(model=MODEL, prompt=PROMPTS[0], logprobs=2, **GREEDY)
    lp = result.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and chosen == pytest.approx(max(top.values()))  # greedy: the best
    echoed = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], logprobs=1, echo=True, **GREEDY
    )
    choice = echoed.choices[0]
    num_prompt = len(tokenizer(PROMPTS[0]).input_ids)
    assert choice.text == PROMPTS[0] + result.choices[0].text
    assert choice.logprobs.token_logprobs[0] is None
    assert len(choice.logprobs.tokens) == num_prompt + 12
    assert all(isinstance(x, float) for x in choice.logprobs.token_logprobs[1:])


def test_chat_logprobs(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "hello"}]
    result = client.chat.completions.create(
        model=MODEL, messages=messages, logprobs=True, top_logprobs=3, **GREEDY
    )
    content = result.choices[0].logprobs.content
    assert len(content) == 12
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)


def test_stop_strings(client: openai.OpenAI) -> None:
    text = (
        client.completions.create(model=MODEL, prompt=PROMPTS[2], **{**GREEDY, "max_tokens": 24})
        .choices[0]
        .text
    )
    stop = next(text[i : i + 2] for i in range(3, len(text) - 1) if text[i : i + 2].strip())
    cut = text.find(stop)
    kwargs = {**GREEDY, "max_tokens": 24}
    result = client.completions.create(model=MODEL, prompt=PROMPTS[2], stop=[stop], **kwargs)
    assert result.choices[0].text == text[:cut]
    assert (
        result.choices[0].finish_reason == "stop"
        and result.choices[0].model_extra["stop_reason"] == stop
    )
    kwargs["extra_body"] = {**kwargs["extra_body"], "include_stop_str_in_output": True}
    included = client.completions.create(model=MODEL, prompt=PROMPTS[2], stop=stop, **kwargs)
    assert included.choices[0].text == text[: cut + len(stop)]
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPTS[2], stop=[stop], stream=True, **GREEDY
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text[:cut]


def test_32_concurrent_clients_match_sequential(
    server: RemoteServer, client: openai.OpenAI
) -> None:
    expected = {p: _greedy_text(client, p) for p in PROMPTS}
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

    async def one(i: int) -> tuple[str, str]:
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 2:
            result = await aclient.completions.create(model=MODEL, prompt=prompt, **GREEDY)
            return prompt, result.choices[0].text
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, stream=True, **GREEDY)
        return prompt, "".join([c.choices[0].text async for c in stream if c.choices])

    async def run() -> list[tuple[str, str]]:
        async with aclient:
            return await asyncio.gather(*(one(i) for i in range(32)))

    results = asyncio.run(run())
    assert len(results) == 32
    for prompt, text in results:
        assert text == expected[prompt]


def test_cache_salt_is_accepted_and_validated(server: RemoteServer, client: openai.OpenAI) -> None:
    salted = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        **{**GREEDY, "extra_body": {"ignore_eos": True, "cache_salt": "tenant-a"}},
    )
    assert salted.choices[0].text == _greedy_text(client, PROMPTS[0])
    _assert_error(
        _post(server, "/v1/completions", {"prompt": "x", "cache_salt": ""}), 400, "cache_salt"
    )


# ---------------------------------------------------------------- disconnects and metrics


def test_disconnect_aborts_and_frees_blocks(server: RemoteServer) -> None:
    before = _metrics(server).get('minivllm:request_success_total{finished_reason="abort"}', 0.0)
    body = {
        "model": MODEL,
        "prompt": PROMPTS[0],
        "max_tokens": 240,
        "n": 4,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    # The client is gone; the server notices, aborts the request and frees its KV blocks.
    samples = _wait_for_metrics(server, lambda m: m["minivllm:num_requests_running"] == 0)
    assert samples["minivllm:kv_cache_usage_perc"] == 0.0
    assert samples["minivllm:num_requests_waiting"] == 0.0
    assert samples['minivllm:request_success_total{finished_reason="abort"}'] == before + 4


def _wait_for_metrics(server: RemoteServer, done: Any, attempts: int = 600) -> dict[str, float]:
    """Poll /metrics until `done(samples)`; the bound only stops a broken server hanging the test."""
    for _ in range(attempts):
        samples = _metrics(server)
        if done(samples):
            return samples
        threading.Event().wait(0.05)
    raise AssertionError(f"metrics never settled: {samples}")


def test_metrics_parse_and_count(server: RemoteServer, client: openai.OpenAI) -> None:
    before = _metrics(server)
    result = client.completions.create(model=MODEL, prompt=PROMPTS[3], **GREEDY)
    after = _wait_for_metrics(
        server,
        lambda m: (
            m["minivllm:e2e_request_latency_seconds_count"]
            > before["minivllm:e2e_request_latency_seconds_count"]
        ),
    )
    for name in (
        "minivllm:num_requests_running",
        "minivllm:num_requests_waiting",
        "minivllm:kv_cache_usage_perc",
        "minivllm:num_preemptions_total",
        'minivllm:request_success_total{finished_reason="stop"}',
    ):
        assert name in after
    assert (
        after["minivllm:prompt_tokens_total"] - before["minivllm:prompt_tokens_total"]
        == result.usage.prompt_tokens
    )
    assert (
        after["minivllm:generation_tokens_total"] - before["minivllm:generation_tokens_total"] == 12
    )
    assert (
        after["minivllm:prefix_cache_queries_total"] > before["minivllm:prefix_cache_queries_total"]
    )
    assert after["minivllm:prefix_cache_hits_total"] >= before["minivllm:prefix_cache_hits_total"]
    assert (
        after["minivllm:time_to_first_token_seconds_count"]
        == before["minivllm:time_to_first_token_seconds_count"] + 1
    )
    assert (
        after["minivllm:inter_token_latency_seconds_count"]
        == before["minivllm:inter_token_latency_seconds_count"] + 11
    )
    success = 'minivllm:request_success_total{finished_reason="length"}'
    assert after[success] == before[success] + 1


# ---------------------------------------------------------------- errors


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
    error = _assert_error(_post(server, "/v1/completions", body), 400, needle)
    assert error["type"] == "invalid_request_error" and error["param"] == field.split("[")[0]


def test_chat_invalid_fields(server: RemoteServer) -> None:
    def chat(**fields: Any) -> httpx.Response:
        return _post(
            server,
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **fields},
        )

    _assert_error(chat(top_logprobs=30, logprobs=True), 400, "top_logprobs", "[0, 20]")
    _assert_error(chat(n=0), 400, "[1, 128]")
    _assert_error(chat(max_completion_tokens=0), 400, "max_completion_tokens")
    _assert_error(_post(server, "/v1/chat/completions", {"messages": []}), 400, "messages")
    bad_role = {"messages": [{"role": "wizard", "content": "x"}]}
    _assert_error(_post(server, "/v1/chat/completions", bad_role), 400, "role")


def test_prompt_too_long(server: RemoteServer, tokenizer: Any) -> None:
    prompt = "hello world " * 200
    length = len(tokenizer(prompt).input_ids)
    assert length > MAX_MODEL_LEN
    error = _assert_error(
        _post(server, "/v1/completions", {"prompt": prompt}), 400, str(MAX_MODEL_LEN), str(length)
    )
    assert error["param"] == "prompt"
    fits = "hello world " * 10
    n = len(tokenizer(fits).input_ids)
    response = _post(
        server, "/v1/completions", {"prompt": fits, "max_tokens": MAX_MODEL_LEN - n + 1}
    )
    _assert_error(response, 400, str(MAX_MODEL_LEN), "max_tokens")
    chat = {"messages": [{"role": "user", "content": prompt}]}
    _assert_error(_post(server, "/v1/chat/completions", chat), 400, str(MAX_MODEL_LEN))


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
    _assert_error(_post(server, "/v1/completions", body), 413, str(BODY_LIMIT))


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
    response = _post(server, path, body)
    assert response.status_code == 400, response.text[:1000]
    assert len(response.content) < 2048, response.content[:1000]
    assert "error" in response.json()


def test_malformed_input_and_unknown_routes(server: RemoteServer) -> None:
    _assert_error(_post(server, "/v1/completions", b"{not json"), 400, "JSON")
    _assert_error(_post(server, "/v1/completions", {"prompt": ""}), 400, "prompt")
    _assert_error(_post(server, "/v1/completions", {"prompt": []}), 400, "prompt")
    _assert_error(_post(server, "/v1/completions", {"prompt": [10**9]}), 400, "vocabulary")
    _assert_error(_post(server, "/v1/completions", {"prompt": {"a": 1}}), 400, "prompt")
    _assert_error(httpx.get(server.url + "/v1/nothing-here"), 404)


def test_bad_requests_do_not_harm_requests_in_flight(
    server: RemoteServer, client: openai.OpenAI
) -> None:
    expected = _greedy_text(client, PROMPTS[1])
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
        return (await http.post(server.url + path, content=content)).status_code

    async def run() -> tuple[list[str], list[int]]:
        async with aclient, httpx.AsyncClient(timeout=60) as http:
            goods = [asyncio.ensure_future(good()) for _ in range(4)]
            codes = await asyncio.gather(*(bad(http, b) for b in bad_bodies * 4))
            return await asyncio.gather(*goods), codes

    texts, codes = asyncio.run(run())
    assert texts == [expected] * 4
    assert set(codes) == {400}


# ---------------------------------------------------------------- API key, chat template, shutdown


def test_api_key(servers: dict[str, RemoteServer]) -> None:
    keyed = servers["keyed"]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.get(keyed.url + "/v1/models", headers=headers)
        _assert_error(response, 401, "API key")
    _assert_error(_post(keyed, "/v1/completions", {"prompt": "hi"}), 401)
    assert httpx.get(keyed.url + "/health").status_code == 200
    assert httpx.get(keyed.url + "/metrics").status_code == 200
    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in good.models.list().data] == [MODEL]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_chat_template_flag(servers: dict[str, RemoteServer], tokenizer: Any) -> None:
    keyed = servers["keyed"]
    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key=API_KEY, max_retries=0)
    messages = [{"role": "user", "content": "hi there"}]
    result = good.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    rendered = "[user]: hi there\n[assistant]:"
    assert result.usage.prompt_tokens == len(
        tokenizer(rendered, add_special_tokens=False).input_ids
    )


def test_benchmark_runs_and_redacts_the_key(
    servers: dict[str, RemoteServer],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util

    from tests.server_utils import REPO_ROOT

    spec = importlib.util.spec_from_file_location(
        "bench_serve", REPO_ROOT / "benchmarks" / "serve.py"
    )
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_serve", bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    result_file = tmp_path / "result.json"
    argv = ["--base-url", servers["keyed"].url, "--api-key", API_KEY, "--num-prompts", "6"]
    argv += ["--input-len", "16", "--output-len", "4", "--max-concurrency", "3"]
    assert bench.main([*argv, "--disable-tqdm", "--result-file", str(result_file)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(result_file.read_text())
    assert result["completed"] == 6 and result["total_output_tokens"] == 24
    assert result["total_input_tokens"] == 6 * 16
    assert {"p50", "p90", "p99"} <= set(result["ttft_ms"]) and "Output token throughput" in printed
    assert API_KEY not in printed and API_KEY not in result_file.read_text()
    assert result["config"]["api_key"] == "<redacted>"


def test_sigterm_with_a_request_in_flight(servers: dict[str, RemoteServer]) -> None:
    """Graceful stop: the streamed request ends (finished, or with an error event) and the server exits 0."""
    keyed = servers["keyed"]
    body = {
        "model": MODEL,
        "prompt": PROMPTS[0],
        "max_tokens": 200,
        "stream": True,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    events = []
    with httpx.stream(
        "POST", keyed.url + "/v1/completions", json=body, headers=headers, timeout=120
    ) as response:
        lines = (line for line in response.iter_lines() if line.startswith("data: "))
        events.append(next(lines))
        keyed.proc.send_signal(signal.SIGTERM)
        events.extend(lines)
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2].removeprefix("data: "))
    assert "error" in last or last["choices"][0]["finish_reason"] == "length"
    assert keyed.stop() == 0
    assert "Traceback" not in keyed.log()
