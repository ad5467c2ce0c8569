"""vLLM's scale-out routes, registered by `--enable-scale-out` (vLLM v0.30, PR #55176).

Render applies the chat template and tokenizes without generating; generate takes
token ids and answers token ids (or text); derender turns generate's tokens-mode
answer back into what the ordinary route answers. A gateway can so tokenize and
detokenize on its own machines and send only token ids to the engines:

    /v1/chat/completions/render -> /inference/v1/generate -> /v1/chat/completions/derender

Without the flag none of these routes exists (404), as in vLLM. docs/scale-out.md
has the shapes and a deployment behind a gateway.
"""

from __future__ import annotations

from fastapi import FastAPI

from minivllm.entrypoints.openai.openapi import body_route
from minivllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from minivllm.entrypoints.openai.protocol_scale_out import (
    DerenderChatRequest,
    DerenderCompletionRequest,
    GenerateRequest,
)
from minivllm.entrypoints.openai.serving_derender import OpenAIServingDerender
from minivllm.entrypoints.openai.serving_engine import ServerState
from minivllm.entrypoints.openai.serving_generate import OpenAIServingGenerate
from minivllm.entrypoints.openai.serving_render import OpenAIServingRender

SCALE_OUT_PATHS = (
    "/v1/completions/render",
    "/v1/chat/completions/render",
    "/v1/completions/derender",
    "/v1/chat/completions/derender",
    "/inference/v1/generate",
)


def add_scale_out_routes(app: FastAPI, state: ServerState) -> None:
    render = OpenAIServingRender(state)
    derender = OpenAIServingDerender(state)
    generate = OpenAIServingGenerate(state)
    generate_requests = {"type": "array", "items": {"type": "object"}}
    routes = (
        (render.render_completion, CompletionRequest, False, generate_requests),
        (render.render_chat, ChatCompletionRequest, False, None),
        (derender.derender_completion, DerenderCompletionRequest, False, None),
        (derender.derender_chat, DerenderChatRequest, False, None),
        (generate.generate, GenerateRequest, True, None),
    )
    for path, (endpoint, model, streams, answer) in zip(SCALE_OUT_PATHS, routes):
        body_route(app, path, endpoint, model, streams, answer)
