"""`POST /v1/chat/completions/render` and `/v1/completions/render` (vLLM's scale-out
routes): the prompt through the chat template and the tokenizer, and the sampling
parameters resolved, as the `GenerateRequest` that `/inference/v1/generate` takes.
The engine never runs."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from minivllm.entrypoints.openai.errors import APIError
from minivllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
)
from minivllm.entrypoints.openai.protocol_scale_out import (
    GenerateRequest,
    GenerateSamplingParams,
    GenerateStreamOptions,
)
from minivllm.entrypoints.openai.serving_chat import OpenAIServingChat
from minivllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from minivllm.entrypoints.openai.serving_engine import OpenAIServing, ServerState, new_request_id
from minivllm.sampling_params import SamplingParams


class OpenAIServingRender(OpenAIServing):
    """What /v1/chat/completions and /v1/completions would queue, without queueing it
    (the same template, tokenization, checks and sampling parameters)."""

    def __init__(self, state: ServerState) -> None:
        super().__init__(state)
        self.completions = OpenAIServingCompletion(state)
        self.chat = OpenAIServingChat(state)

    async def render_chat(self, raw_request: Request) -> JSONResponse:
        """The `GenerateRequest` that /v1/chat/completions would run for this body."""
        request: ChatCompletionRequest = await self.parse(raw_request, ChatCompletionRequest)
        self.check_model(request.model)
        _, _, prompt_ids, params = await self.chat.prepare(request)
        rendered = _generate_request(new_request_id("chatcmpl"), prompt_ids, params, request)
        return JSONResponse(rendered)

    async def render_completion(self, raw_request: Request) -> JSONResponse:
        """One `GenerateRequest` per prompt of this /v1/completions body."""
        request: CompletionRequest = await self.parse(raw_request, CompletionRequest)
        self.check_model(request.model)
        if request.echo or request.max_tokens == 0:
            raise APIError(
                400,
                "echo and prompt scoring (max_tokens=0) are not supported by render: a "
                "generate answer holds only the output",
                "echo" if request.echo else "max_tokens",
            )
        prompts = await self.completions._prompts(request.prompt)
        lengths = [len(p.token_ids) for p in prompts]
        self.check_request_size(
            lengths,
            request.n,
            request.max_tokens or self.state.max_model_len - min(lengths),
            request.logprobs,
        )
        rendered = []
        for prompt in prompts:
            max_tokens = self.check_length(len(prompt.token_ids), request.max_tokens, "prompt")
            params = self.sampling_params(request, max_tokens, request.logprobs)
            request_id = new_request_id("cmpl")
            rendered.append(_generate_request(request_id, prompt.token_ids, params, request))
        return JSONResponse(rendered)


def _generate_request(
    request_id: str, token_ids: list[int], params: SamplingParams, request: SamplingRequest
) -> dict[str, Any]:
    """Render's answer: the body /inference/v1/generate takes, as JSON."""
    stream_options = None
    if request.stream:
        stream_options = GenerateStreamOptions(include_usage=request.include_usage)
    rendered = GenerateRequest(
        request_id=request_id,
        token_ids=token_ids,
        sampling_params=GenerateSamplingParams.from_params(params),
        model=request.model,
        stream=request.stream,
        stream_options=stream_options,
        cache_salt=request.cache_salt,
    )
    return rendered.model_dump(mode="json", by_alias=True)
