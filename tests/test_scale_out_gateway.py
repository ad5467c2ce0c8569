"""Two `minivllm serve` replicas behind the Shepherd Model Gateway (`smg launch`, HTTP
workers, round robin), driven with the real `openai` client (docs/scale-out.md)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.gateway_utils import Gateway
from tests.server_utils import (
    MAX_MODEL_LEN,
    MODEL,
    PROMPTS,
    RemoteServer,
    assert_error,
    metrics,
    post,
    tiny_server_args,
)

GREEDY = {"temperature": 0.0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}
FINISHED = 'minivllm:request_success_total{finished_reason="length"}'


@pytest.fixture(scope="module")
def replicas(
    qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[RemoteServer]]:
    """Two plain replicas (no --enable-scale-out: the gateway speaks the OpenAI routes)."""
    logs = tmp_path_factory.mktemp("replicas")
    args = tiny_server_args()
    started = [RemoteServer(qwen3_dir, args, logs / f"replica{i}.log") for i in range(2)]
    try:
        for replica in started:
            replica.wait_ready()
        yield started
    finally:
        statuses = [replica.stop() for replica in started]
    assert statuses == [0, 0], [r.log()[-2000:] for r in started]


@pytest.fixture(scope="module")
def gateway(
    replicas: list[RemoteServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    log = tmp_path_factory.mktemp("gateway") / "smg.log"
    urls = [replica.url for replica in replicas]
    assert all(url is not None for url in urls)
    started = Gateway(urls, log)  # type: ignore[arg-type]
    try:
        yield started.wait_ready(len(urls))
    finally:
        started.stop()


def test_gateway_answers_as_a_replica_and_spreads_the_load(
    gateway: Gateway, replicas: list[RemoteServer]
) -> None:
    before = [metrics(r).get(FINISHED, 0.0) for r in replicas]
    through = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    direct = openai.OpenAI(base_url=replicas[0].url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in through.models.list().data] == [MODEL]
    for prompt in PROMPTS:
        got = through.completions.create(model=MODEL, prompt=prompt, **GREEDY)
        want = direct.completions.create(model=MODEL, prompt=prompt, **GREEDY)
        assert got.choices[0].text == want.choices[0].text
        assert got.usage == want.usage
    messages = [{"role": "user", "content": "Hello"}]
    got_chat = through.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    want_chat = direct.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert got_chat.choices[0].message.content == want_chat.choices[0].message.content
    stream = through.completions.create(model=MODEL, prompt=PROMPTS[0], stream=True, **GREEDY)
    streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert (
        streamed
        == direct.completions.create(model=MODEL, prompt=PROMPTS[0], **GREEDY).choices[0].text
    )
    # 6 requests through the gateway, round robin: each replica answered some of them
    served = [metrics(r).get(FINISHED, 0.0) - b for r, b in zip(replicas, before)]
    direct_requests = [6, 0]
    through_gateway = [s - d for s, d in zip(served, direct_requests)]
    assert sum(through_gateway) == 6 and min(through_gateway) >= 1, through_gateway


def test_gateway_passes_errors_through(gateway: Gateway) -> None:
    """A replica's 400 reaches the client as the OpenAI error it is."""
    through = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        through.completions.create(model=MODEL, prompt="a", max_tokens=10 * MAX_MODEL_LEN)


@pytest.mark.parametrize(
    "path",
    [
        "/v1/completions/render",
        "/v1/chat/completions/render",
        "/v1/completions/derender",
        "/v1/chat/completions/derender",
        "/inference/v1/generate",
    ],
)
def test_scale_out_routes_are_404_without_the_flag(replicas: list[RemoteServer], path: str) -> None:
    body = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}}
    assert_error(post(replicas[0], path, body), 404, "Not Found")
