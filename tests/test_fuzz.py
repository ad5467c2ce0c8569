"""Fuzzing: schemathesis against the server's OpenAPI document, hypothesis on the models.

The server runs with an API key and every route (scale-out included). Whatever
arrives, it must answer without a 5xx, with a status and body its document
promises, and with an error body of bounded size. `tools/fuzz_server.py` runs
the same checks with many more examples.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.config import SchemathesisConfig

from minivllm.entrypoints.openai.errors import MAX_MESSAGE_CHARS, from_validation_error
from minivllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from minivllm.sampling_params import SamplingParams
from tests.server_utils import RemoteServer, tiny_server_args

API_KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_ERROR_BODY_BYTES = 2048  # docs/limits.md: an error body stays under ~1.3 KB
# --max-tokens-per-request 2048 below: a few tokens' text each, plus logprobs
MAX_BODY_BYTES = 8 << 20
# CI's depth; tools/fuzz_server.py sets MINIVLLM_FUZZ_EXAMPLES for a deeper run
EXAMPLES_PER_ROUTE = int(os.environ.get("MINIVLLM_FUZZ_EXAMPLES", "12"))
MODEL_EXAMPLES = 12 * EXAMPLES_PER_ROUTE
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def fuzz_server(
    qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RemoteServer]:
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    server = RemoteServer(
        qwen3_dir,
        # generation stays short, so examples stay cheap; the limits are what is fuzzed.
        # --max-model-len 96: a request without max_tokens generates to the context's end,
        # and at 256 the ~90 chat requests that get a 200 took 36 of the test's ~100 s
        tiny_server_args(
            *("--api-key", API_KEY, "--enable-scale-out", "--max-tokens-per-request", "2048"),
            max_model_len=96,
        ),
        log,
    )
    try:
        yield server.wait_ready()
    finally:
        status = server.stop()
    assert status == 0, server.log()[-4000:]
    assert "Traceback" not in server.log(), server.log()[-4000:]


# The coverage phase (every field's boundary and wrong-type values, ~5,000 requests here)
# runs on every route but the two render routes: they take the very request models of
# /v1/completions and /v1/chat/completions, whose handlers validate and render a prompt
# with the same code before generating, so their coverage cases repeated those routes'
# (~1,300 requests, ~16 s). They keep the fuzzing phase's examples.
CONFIG = SchemathesisConfig.from_dict(
    {"operations": [{"include-path-regex": "/render$", "phases": {"coverage": {"enabled": False}}}]}
)


@pytest.fixture(scope="module")
def api_schema(fuzz_server: RemoteServer) -> Any:
    return schemathesis.openapi.from_url(
        fuzz_server.url + "/openapi.json", headers=AUTH, config=CONFIG
    )


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_ROUTE,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=EXAMPLES_PER_ROUTE == 12,  # CI: the same examples every run (reproducible)
)
def test_server_answers_every_generated_request_within_its_document(case: Any) -> None:
    response = case.call(headers=AUTH, timeout=120)
    case.validate_response(response, checks=CHECKS)
    if response.status_code >= 400:
        assert len(response.content) <= MAX_ERROR_BODY_BYTES, response.content[:300]
    assert len(response.content) <= MAX_BODY_BYTES


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)
FIELDS = sorted(
    {*CompletionRequest.model_fields, *ChatCompletionRequest.model_fields, "messages", "prompt"}
)
# request-shaped bodies: known field names with arbitrary JSON values
BODIES = st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6)


@pytest.mark.parametrize(
    "model", [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest]
)
@settings(max_examples=MODEL_EXAMPLES, deadline=None)
@given(body=BODIES)
def test_request_models_accept_or_refuse_with_a_bounded_error(
    model: type[BaseModel], body: dict[str, Any]
) -> None:
    text = json.dumps(body, allow_nan=True)
    try:
        request = model.model_validate_json(text)
    except ValidationError as exc:
        error = from_validation_error(exc, model)
        assert error.status == 400 and len(error.message) <= MAX_MESSAGE_CHARS
        return
    if isinstance(request, (CompletionRequest, ChatCompletionRequest)):
        try:  # what the server does next: only ValueError/TypeError may come out
            request.to_sampling_params(16, None)
        except (ValueError, TypeError):
            pass


SAMPLING_FIELDS = [f for f in SamplingParams.__dataclass_fields__ if f != "all_stop_token_ids"]


@settings(max_examples=2 * MODEL_EXAMPLES, deadline=None)
@given(kwargs=st.dictionaries(st.sampled_from(SAMPLING_FIELDS), JSON, max_size=5))
def test_sampling_params_accept_or_refuse_with_value_or_type_errors(kwargs: dict) -> None:
    try:
        params = SamplingParams(**kwargs)
    except (ValueError, TypeError):
        return
    # accepted: the engine's own uses of it work
    assert params.n >= 1 and params.clone() == params
    assert params.max_stop_str_len >= 0 and isinstance(params.is_greedy, bool)
