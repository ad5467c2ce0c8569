"""End to end: the real `minivllm serve` in a subprocess, driven with the official `openai` client."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server_utils import (
    API_KEY,
    GREEDY,
    MAX_MODEL_LEN,
    MODEL,
    PROMPTS,
    RemoteServer,
    assert_error,
    greedy_text,
    metrics,
    post,
)

# ---------------------------------------------------------------- routes


def test_models_health_version(server: RemoteServer, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def test_tokenize_detokenize(server: RemoteServer, tokenizer: Any) -> None:
    ids = tokenizer(PROMPTS[2]).input_ids
    body = post(server, "/tokenize", {"model": MODEL, "prompt": PROMPTS[2]}).json()
    assert (
        body["tokens"] == ids
        and body["count"] == len(ids)
        and body["max_model_len"] == MAX_MODEL_LEN
    )
    assert post(server, "/detokenize", {"tokens": ids}).json()["prompt"] == PROMPTS[2]
    messages = [{"role": "user", "content": "hi"}]
    chat_ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert post(server, "/tokenize", {"messages": messages}).json()["tokens"] == list(chat_ids)


# ---------------------------------------------------------------- completions and chat


def test_completion_usage_matches_tokenizer(client: openai.OpenAI, tokenizer: Any) -> None:
    result = client.completions.create(model=MODEL, prompt=PROMPTS[0], **GREEDY)
    choice = result.choices[0]
    assert result.usage.prompt_tokens == len(tokenizer(PROMPTS[0]).input_ids)
    assert result.usage.completion_tokens == 12 and choice.finish_reason == "length"
    assert result.usage.total_tokens == result.usage.prompt_tokens + 12


def test_token_id_prompts_and_batches(client: openai.OpenAI, tokenizer: Any) -> None:
    texts = [greedy_text(client, p) for p in PROMPTS[:2]]
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
    expected = {p: greedy_text(client, p) for p in PROMPTS}
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
    assert salted.choices[0].text == greedy_text(client, PROMPTS[0])
    assert_error(
        post(server, "/v1/completions", {"prompt": "x", "cache_salt": ""}), 400, "cache_salt"
    )


# ---------------------------------------------------------------- disconnects and metrics


def test_disconnect_aborts_and_frees_blocks(server: RemoteServer) -> None:
    before = metrics(server).get('minivllm:request_success_total{finished_reason="abort"}', 0.0)
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
        samples = metrics(server)
        if done(samples):
            return samples
        threading.Event().wait(0.05)
    raise AssertionError(f"metrics never settled: {samples}")


def test_metrics_parse_and_count(server: RemoteServer, client: openai.OpenAI) -> None:
    before = metrics(server)
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


# ---------------------------------------------------------------- API key, chat template, shutdown


def test_api_key(servers: dict[str, RemoteServer]) -> None:
    keyed = servers["keyed"]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.get(keyed.url + "/v1/models", headers=headers)
        assert_error(response, 401, "API key")
    assert_error(post(keyed, "/v1/completions", {"prompt": "hi"}), 401)
    assert httpx.get(keyed.url + "/health").status_code == 200
    assert httpx.get(keyed.url + "/metrics").status_code == 200
    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in good.models.list().data] == [MODEL]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_a_bf16_kv_cache_serves_and_says_so(
    servers: dict[str, RemoteServer], server: RemoteServer
) -> None:
    """The keyed server runs `--kv-cache-dtype bfloat16`: it completes through the openai
    client, and cache_config_info reports each server's cache dtype and its blocks (the
    bf16 one holds twice the blocks of its 1 MiB an fp32 cache would)."""
    keyed = servers["keyed"]
    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key=API_KEY, max_retries=0)
    result = good.completions.create(model=MODEL, prompt=PROMPTS[0], **GREEDY)
    assert result.usage.completion_tokens == 12
    info = {}
    for name, srv in (("keyed", keyed), ("main", server)):
        text = httpx.get(srv.url + "/metrics", headers={"Authorization": API_KEY}).text
        (line,) = [x for x in text.splitlines() if x.startswith("minivllm:cache_config_info{")]
        assert line.endswith(" 1.0")
        info[name] = dict(re.findall(r'(\w+)="([^"]*)"', line))
    assert info["keyed"]["cache_dtype"] == "bfloat16"
    assert info["main"]["cache_dtype"] == "auto"
    assert info["main"]["block_size"] == info["keyed"]["block_size"]
    # 1 MiB of bf16 blocks against 4 MiB of fp32 ones: half as many (each count rounded down)
    main_blocks = int(info["main"]["num_gpu_blocks"])
    assert abs(main_blocks - 2 * int(info["keyed"]["num_gpu_blocks"])) <= 1


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
