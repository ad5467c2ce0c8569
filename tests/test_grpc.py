"""End to end: `minivllm serve --grpc` in a subprocess, driven by a real gRPC client built from
the published `smg-grpc-proto` stubs (vLLM's `vllm.grpc.engine.VllmEngine` service)."""

from __future__ import annotations

import hashlib
import io
import re
import signal
import time
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from minivllm import SamplingParams
from tests.gateway_utils import Gateway
from tests.server_utils import MAX_MODEL_LEN, MODEL, PROMPTS, RemoteServer, metrics, post

KEY = "grpc-test-key"
AUTH = [("authorization", f"Bearer {KEY}")]
TIMEOUT = 120.0  # per call: guards against a hang, never decides a test
_GRPC_LINE = re.compile(r"over gRPC \(vllm\.grpc\.engine\.VllmEngine\) at (\S+)")
Code = grpc.StatusCode


def grpc_address(server: RemoteServer, timeout: float = 180.0) -> str:
    """The gRPC address from the start-up log, once HealthCheck answers there."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"the server exited with {server.proc.returncode}:\n{server.log()}")
        match = _GRPC_LINE.search(server.log())
        if match is not None:
            stub = pb_grpc.VllmEngineStub(grpc.insecure_channel(match.group(1)))
            try:
                stub.HealthCheck(pb.HealthCheckRequest(), timeout=5)
                return match.group(1)
            except grpc.RpcError:
                pass
        time.sleep(0.1)
    raise RuntimeError(f"the gRPC server did not become ready:\n{server.log()}")


@pytest.fixture(scope="module")
def servers(qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """`main`: HTTP and gRPC (--grpc --grpc-port 0) with an API key; `only`: `--grpc` alone,
    gRPC instead of HTTP on --port (as `vllm serve --grpc`). Started together."""
    logs = tmp_path_factory.mktemp("grpc-logs")
    common = ["--served-model-name", MODEL, "--dtype", "float32"]
    common += ["--max-model-len", str(MAX_MODEL_LEN), "--grpc"]
    main = RemoteServer(
        qwen3_dir,
        [*common, "--grpc-port", "0", "--api-key", KEY, "--kv-cache-memory-bytes", "4MiB"],
        logs / "main.log",
    )
    only = RemoteServer(
        qwen3_dir,
        [*common, "--kv-cache-memory-bytes", "1MiB", "--shutdown-timeout", "60"],
        logs / "only.log",
    )
    try:
        main.wait_ready()
        yield {
            "main": main,
            "main_grpc": grpc_address(main),
            "only": only,
            "only_grpc": grpc_address(only),
        }
    finally:
        statuses = {name: s.stop() for name, s in {"main": main, "only": only}.items()}
    for name, server in (("main", main), ("only", only)):
        assert statuses[name] == 0, server.log()[-4000:]
        assert "Traceback" not in server.log(), server.log()[-4000:]


@pytest.fixture(scope="module")
def stub(servers: dict) -> pb_grpc.VllmEngineStub:
    return pb_grpc.VllmEngineStub(grpc.insecure_channel(servers["main_grpc"]))


def call(stub: pb_grpc.VllmEngineStub, method: str, request: Any, **kwargs: Any) -> Any:
    return getattr(stub, method)(request, metadata=AUTH, timeout=TIMEOUT, **kwargs)


def generate(stub: pb_grpc.VllmEngineStub, **fields: Any) -> list[pb.GenerateResponse]:
    return list(call(stub, "Generate", pb.GenerateRequest(**fields)))


def greedy(max_tokens: int = 12, **fields: Any) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **fields)


def completes(responses: list[pb.GenerateResponse]) -> dict[int, pb.GenerateComplete]:
    done = [r.complete for r in responses if r.WhichOneof("response") == "complete"]
    return {c.index: c for c in done}


def streamed_ids(responses: list[pb.GenerateResponse]) -> dict[int, list[int]]:
    ids: dict[int, list[int]] = {}
    for r in responses:
        if r.WhichOneof("response") == "chunk":
            ids.setdefault(r.chunk.index, []).extend(r.chunk.token_ids)
    return ids


def rpc_error(fn: Any, *args: Any, **kwargs: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        result = fn(*args, **kwargs)
        if isinstance(result, Iterator):
            list(result)
    return info.value


@pytest.fixture(scope="module")
def oracle(qwen3_llm: Any) -> dict[str, list[int]]:
    """Greedy continuations from the offline `LLM` (not the server): prompt -> token ids."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = qwen3_llm.generate(PROMPTS, params, use_tqdm=False)
    return {p: list(o.outputs[0].token_ids) for p, o in zip(PROMPTS, outputs)}


# ---------------------------------------------------------------- Generate


def test_greedy_tokens_equal_the_offline_llm_and_http(
    servers: dict, stub: Any, tokenizer: Any, oracle: dict[str, list[int]]
) -> None:
    for prompt in PROMPTS[:2]:
        ids = tokenizer(prompt).input_ids
        tokenized = pb.TokenizedInput(original_text=prompt, input_ids=ids)
        (done,) = completes(generate(stub, tokenized=tokenized, sampling_params=greedy())).values()
        assert list(done.output_ids) == oracle[prompt]
        assert (done.finish_reason, done.prompt_tokens, done.completion_tokens) == (
            "length",
            len(ids),
            12,
        )
        body = {"model": MODEL, "prompt": ids, "temperature": 0, "max_tokens": 12}
        headers = {"authorization": f"Bearer {KEY}"}
        http = post(
            servers["main"], "/v1/completions", {**body, "ignore_eos": True}, headers=headers
        )
        text = tokenizer.decode(done.output_ids, skip_special_tokens=True)
        assert http.json()["choices"][0]["text"] == text


def test_text_input_streams_the_same_tokens(
    stub: Any, tokenizer: Any, oracle: dict[str, list[int]]
) -> None:
    prompt = PROMPTS[2]
    responses = generate(stub, text=prompt, sampling_params=greedy(), stream=True)
    chunks = [r.chunk for r in responses if r.WhichOneof("response") == "chunk"]
    assert [r.WhichOneof("response") for r in responses][-1] == "complete"
    assert streamed_ids(responses)[0] == oracle[prompt]
    assert sum(c.completion_tokens for c in chunks) == 12
    assert {c.prompt_tokens for c in chunks} == {len(tokenizer(prompt).input_ids)}
    (done,) = completes(responses).values()
    # as vLLM's servicer: the complete repeats the last chunk's ids
    assert done.finish_reason == "length" and list(done.output_ids) == list(chunks[-1].token_ids)


def test_n_samples_streamed_and_whole(stub: Any) -> None:
    params = pb.SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, n=3)
    whole = completes(generate(stub, text=PROMPTS[0], sampling_params=params))
    assert sorted(whole) == [0, 1, 2]
    assert all(c.completion_tokens == 6 and c.finish_reason == "length" for c in whole.values())
    streamed = generate(stub, text=PROMPTS[0], sampling_params=params, stream=True)
    assert sorted(completes(streamed)) == [0, 1, 2]
    assert streamed_ids(streamed) == {i: list(c.output_ids) for i, c in whole.items()}
    assert len({tuple(c.output_ids) for c in whole.values()}) > 1  # seeded, not identical


def test_stop_strings_and_stop_token_ids(
    stub: Any, tokenizer: Any, oracle: dict[str, list[int]]
) -> None:
    prompt = PROMPTS[0]
    tokenized = pb.TokenizedInput(input_ids=tokenizer(prompt).input_ids)
    stop_id = oracle[prompt][3]
    (done,) = completes(
        generate(stub, tokenized=tokenized, sampling_params=greedy(stop_token_ids=[stop_id]))
    ).values()
    first = oracle[prompt].index(stop_id)
    assert done.finish_reason == "stop" and done.WhichOneof("matched_stop") == "matched_token_id"
    assert done.matched_token_id == stop_id and list(done.output_ids) == oracle[prompt][: first + 1]
    text = tokenizer.decode(oracle[prompt])
    stop = text[len(text) // 4 :][:3]
    for stream in (False, True):
        responses = generate(
            stub, tokenized=tokenized, sampling_params=greedy(stop=[stop]), stream=stream
        )
        (done,) = completes(responses).values()
        assert done.finish_reason == "stop" and done.matched_stop_str == stop
        ids = streamed_ids(responses)[0] if stream else list(done.output_ids)
        assert stop in tokenizer.decode(ids) and len(ids) < 12


def test_logprobs_and_prompt_logprobs(stub: Any, tokenizer: Any) -> None:
    ids = tokenizer(PROMPTS[1]).input_ids
    params = greedy(max_tokens=5, logprobs=2, prompt_logprobs=1)
    tokenized = pb.TokenizedInput(input_ids=ids)
    (done,) = completes(generate(stub, tokenized=tokenized, sampling_params=params)).values()
    out = done.output_logprobs
    assert list(out.token_ids) == list(done.output_ids) and len(out.token_logprobs) == 5
    for chosen, top in zip(out.token_logprobs, out.top_logprobs):
        assert len(top.values) == 2 and top.values[0] >= top.values[1]
        assert chosen == pytest.approx(top.values[0])  # greedy takes the most likely token
    inputs = done.input_logprobs
    assert list(inputs.token_ids) == ids and len(inputs.top_logprobs) == len(ids)
    assert not inputs.token_logprobs[0].HasField("value")
    assert all(lp.HasField("value") and lp.value <= 0 for lp in inputs.token_logprobs[1:])
    streamed = generate(stub, tokenized=tokenized, sampling_params=params, stream=True)
    chunks = [r.chunk for r in streamed if r.WhichOneof("response") == "chunk"]
    assert chunks[0].input_logprobs == inputs and not chunks[1].HasField("input_logprobs")
    assert [c.output_logprobs.token_logprobs[0] for c in chunks] == list(out.token_logprobs)


def test_structured_output_choice(stub: Any, tokenizer: Any) -> None:
    choices = ["yes", "no", "maybe"]
    params = pb.SamplingParams(
        temperature=0.0, max_tokens=8, choice=pb.ChoiceConstraint(choices=choices)
    )
    (done,) = completes(generate(stub, text=PROMPTS[3], sampling_params=params)).values()
    assert tokenizer.decode(done.output_ids, skip_special_tokens=True) in choices


def test_concurrent_streams(stub: Any, tokenizer: Any, oracle: dict[str, list[int]]) -> None:
    def run(prompt: str) -> dict[int, list[int]]:
        tokenized = pb.TokenizedInput(input_ids=tokenizer(prompt).input_ids)
        return streamed_ids(
            generate(stub, tokenized=tokenized, sampling_params=greedy(), stream=True)
        )

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(run, PROMPTS))
    assert [r[0] for r in results] == [oracle[p] for p in PROMPTS]


def _active(stub: Any) -> int:
    return call(stub, "GetServerInfo", pb.GetServerInfoRequest()).active_requests


def _wait_idle(stub: Any) -> int:
    deadline = time.monotonic() + 60
    while _active(stub) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _active(stub)


def test_cancelling_a_stream_aborts_the_request(servers: dict, stub: Any) -> None:
    aborted = 'minivllm:request_success_total{finished_reason="abort"}'
    before = metrics(servers["main"]).get(aborted, 0.0)
    stream = call(
        stub,
        "Generate",
        pb.GenerateRequest(text=PROMPTS[0], sampling_params=greedy(200), stream=True),
    )
    for _, _ in zip(range(2), stream):
        pass
    assert _active(stub) == 1
    stream.cancel()
    assert _wait_idle(stub) == 0
    deadline = time.monotonic() + 60  # the engine applies the abort on its next turn
    while metrics(servers["main"])[aborted] == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metrics(servers["main"])[aborted] == before + 1


def test_abort_rpc_finishes_the_request_with_abort(stub: Any) -> None:
    request = pb.GenerateRequest(
        request_id="to-abort", text=PROMPTS[1], sampling_params=greedy(200), stream=True
    )
    responses = []
    for response in call(stub, "Generate", request):
        responses.append(response)
        if len(responses) == 2:
            call(stub, "Abort", pb.AbortRequest(request_ids=["to-abort", "unknown-id"]))
    (done,) = completes(responses).values()
    assert done.finish_reason == "abort" and len(streamed_ids(responses)[0]) < 200


# ---------------------------------------------------------------- refusals


def _tokens(n: int) -> pb.TokenizedInput:
    return pb.TokenizedInput(input_ids=[5] * n)


@pytest.mark.parametrize(
    "fields, code, needle",
    [
        ({}, Code.INVALID_ARGUMENT, "no prompt"),
        ({"tokenized": _tokens(0)}, Code.INVALID_ARGUMENT, "empty"),
        ({"tokenized": pb.TokenizedInput(input_ids=[3, 10**6])}, Code.INVALID_ARGUMENT, "1000000"),
        ({"tokenized": _tokens(MAX_MODEL_LEN)}, Code.INVALID_ARGUMENT, "maximum context length"),
        (
            {"tokenized": _tokens(10), "sampling_params": pb.SamplingParams(max_tokens=250)},
            Code.INVALID_ARGUMENT,
            "max_tokens",
        ),
        ({"sampling_params": pb.SamplingParams(max_tokens=0)}, Code.INVALID_ARGUMENT, "max_tokens"),
        ({"sampling_params": pb.SamplingParams(n=129)}, Code.INVALID_ARGUMENT, "[1, 128]"),
        ({"sampling_params": pb.SamplingParams(temperature=-1)}, Code.INVALID_ARGUMENT, "temp"),
        ({"sampling_params": pb.SamplingParams(logprobs=21)}, Code.INVALID_ARGUMENT, "[0, 20]"),
        ({"sampling_params": pb.SamplingParams(stop=["x"] * 65)}, Code.INVALID_ARGUMENT, "64"),
        ({"sampling_params": pb.SamplingParams(stop=["y" * 5000])}, Code.INVALID_ARGUMENT, "1024"),
        (
            {"sampling_params": pb.SamplingParams(logit_bias={i: 1.0 for i in range(2000)})},
            Code.INVALID_ARGUMENT,
            "logit_bias",
        ),
        ({"sampling_params": pb.SamplingParams(regex="(" * 3000)}, Code.INVALID_ARGUMENT, ""),
        ({"sampling_params": pb.SamplingParams(structural_tag="{}")}, Code.UNIMPLEMENTED, "tag"),
        ({"request_id": "r" * 5000}, Code.INVALID_ARGUMENT, "request_id"),
        ({"mm_inputs": pb.MultimodalInputs(im_token_id=1)}, Code.UNIMPLEMENTED, "multimodal"),
        ({"kv_transfer_params_json": "{}"}, Code.UNIMPLEMENTED, "KV transfer"),
    ],
)
def test_bad_requests_get_a_status_with_a_bounded_message(
    stub: Any, fields: dict, code: grpc.StatusCode, needle: str
) -> None:
    if fields and "tokenized" not in fields:
        fields = {"text": "hello", **fields}
    error = rpc_error(generate, stub, **fields)
    assert error.code() == code, error.details()
    assert needle in error.details() and len(error.details()) <= 1024
    assert "yyyyyyyyyy" not in error.details() and "((((((((((" not in error.details()


def test_text_over_the_character_bound_is_refused_before_tokenizing(stub: Any) -> None:
    error = rpc_error(generate, stub, text="word " * 100_000)
    assert error.code() == Code.INVALID_ARGUMENT and "characters" in error.details()
    assert len(error.details()) <= 1024


def test_api_key_is_required_except_for_health(servers: dict) -> None:
    bare = pb_grpc.VllmEngineStub(grpc.insecure_channel(servers["main_grpc"]))
    assert bare.HealthCheck(pb.HealthCheckRequest(), timeout=TIMEOUT).healthy
    for metadata in (None, [("authorization", "Bearer wrong")], [("authorization", KEY)]):
        for method, request in (
            ("GetModelInfo", pb.GetModelInfoRequest()),
            ("Generate", pb.GenerateRequest(text="hi")),
            ("GetTokenizer", common_pb2.GetTokenizerRequest()),
        ):
            error = rpc_error(getattr(bare, method), request, metadata=metadata, timeout=TIMEOUT)
            assert error.code() == Code.UNAUTHENTICATED and "API key" in error.details()


# ---------------------------------------------------------------- the other RPCs


def test_model_server_info_and_loads(stub: Any, tokenizer: Any) -> None:
    generate(stub, text="hi", sampling_params=greedy(1))
    info = call(stub, "GetModelInfo", pb.GetModelInfoRequest())
    assert info.served_model_name == MODEL and info.is_generation and not info.supports_vision
    assert (info.max_context_length, info.max_req_input_len) == (MAX_MODEL_LEN, MAX_MODEL_LEN - 1)
    assert info.vocab_size >= len(tokenizer) and list(info.architectures) == ["Qwen3ForCausalLM"]
    assert info.model_type == "qwen3" and tokenizer.eos_token_id in info.eos_token_ids
    server = call(stub, "GetServerInfo", pb.GetServerInfoRequest())
    assert server.server_type == "vllm-grpc" and server.data_parallel_size == 1
    assert server.block_size > 0 and server.max_num_seqs > 0 and server.uptime_seconds > 0
    assert server.model_dtype == "torch.float32" and server.last_receive_timestamp > 0
    loads = call(stub, "GetLoads", pb.GetLoadsRequest())
    assert loads.dp_rank_count == 1 and len(loads.loads) == 1 and loads.version
    (load,) = loads.loads
    assert load.max_total_num_tokens > 0 and load.max_running_requests == server.max_num_seqs
    assert load.num_running_reqs == load.num_waiting_reqs == 0 and 0 <= load.token_usage < 1


def test_get_tokenizer_streams_the_files_zipped(stub: Any, qwen3_dir: Path) -> None:
    chunks = list(call(stub, "GetTokenizer", common_pb2.GetTokenizerRequest()))
    data = b"".join(c.data for c in chunks)
    assert [bool(c.sha256) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    archive = zipfile.ZipFile(io.BytesIO(data))
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(archive.namelist())
    assert archive.read("tokenizer.json") == (qwen3_dir / "tokenizer.json").read_bytes()


def test_flush_cache_drops_the_prefix_cache_when_idle(stub: Any) -> None:
    request = pb.GenerateRequest(tokenized=_tokens(140), sampling_params=greedy(2))

    def cached_tokens() -> int:
        (done,) = completes(list(call(stub, "Generate", request))).values()
        return done.cached_tokens

    cached_tokens()
    assert cached_tokens() == 128  # one full block of the default CPU block size
    running = call(
        stub, "Generate", pb.GenerateRequest(text="busy", sampling_params=greedy(200), stream=True)
    )
    next(running)
    refused = call(stub, "FlushCache", common_pb2.FlushCacheRequest(timeout_s=0))
    assert not refused.success and "running" in refused.message
    running.cancel()
    assert _wait_idle(stub) == 0
    flushed = call(stub, "FlushCache", common_pb2.FlushCacheRequest(timeout_s=60))
    assert flushed.success
    assert cached_tokens() == 0
    bad = rpc_error(call, stub, "FlushCache", common_pb2.FlushCacheRequest(timeout_s=-1))
    assert bad.code() == Code.INVALID_ARGUMENT


@pytest.mark.parametrize(
    "method, request_",
    [
        ("Embed", pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=[1, 2]))),
        ("StartProfile", common_pb2.StartProfileRequest()),
        ("StopProfile", common_pb2.StopProfileRequest()),
        ("SubscribeKvEvents", common_pb2.SubscribeKvEventsRequest()),
    ],
)
def test_capabilities_minivllm_lacks_are_unimplemented(
    stub: Any, method: str, request_: Any
) -> None:
    error = rpc_error(call, stub, method, request_)
    assert error.code() == Code.UNIMPLEMENTED and "minivllm" in error.details()


# ---------------------------------------------------------------- a gateway written for vLLM


def test_smg_gateway_serves_openai_clients_through_grpc(
    servers: dict, tmp_path: Path, tokenizer: Any, oracle: dict[str, list[int]]
) -> None:
    """The Shepherd Model Gateway, unchanged, in front of the `--grpc` server as a vLLM
    gRPC worker: it reads the model info, tokenizes, and streams through Generate."""
    gateway = Gateway([f"grpc://{servers['only_grpc']}"], tmp_path / "smg.log")
    try:
        gateway.wait_ready(num_workers=1)
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
        body: dict[str, Any] = dict(
            model=MODEL,
            prompt=PROMPTS[0],
            temperature=0,
            max_tokens=12,
            extra_body={"ignore_eos": True},
        )
        whole = client.completions.create(**body)
        assert whole.choices[0].text == tokenizer.decode(
            oracle[PROMPTS[0]], skip_special_tokens=True
        )
        assert whole.usage.completion_tokens == 12
        chunks = client.completions.create(**body, stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    finally:
        gateway.stop()


# ---------------------------------------------------------------- `--grpc` alone


def test_grpc_only_server_serves_no_http_and_drains_on_sigterm(
    servers: dict, tokenizer: Any, oracle: dict[str, list[int]]
) -> None:
    only: RemoteServer = servers["only"]
    assert "http://" not in only.log()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://{servers['only_grpc']}/health", timeout=10)
    stub = pb_grpc.VllmEngineStub(grpc.insecure_channel(servers["only_grpc"]))
    ids = tokenizer(PROMPTS[3]).input_ids
    request = pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=ids))
    request.sampling_params.CopyFrom(greedy())
    (done,) = completes(list(stub.Generate(request, timeout=TIMEOUT))).values()
    assert list(done.output_ids) == oracle[PROMPTS[3]]  # no API key on this server
    running = stub.Generate(
        pb.GenerateRequest(text=PROMPTS[0], sampling_params=greedy(100), stream=True),
        timeout=TIMEOUT,
    )
    next(running)
    only.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 60
    while stub.HealthCheck(pb.HealthCheckRequest(), timeout=TIMEOUT).healthy:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    refused = rpc_error(stub.Generate, request, timeout=TIMEOUT)
    assert refused.code() == Code.UNAVAILABLE
    rest = list(running)  # the request in flight finishes
    assert rest[-1].complete.finish_reason == "length"
    assert only.proc.wait(60) == 0
