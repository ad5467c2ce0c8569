"""`POST /v1/chat/completions`: messages through the chat template, streamed or whole."""

from __future__ import annotations

import copy
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from minivllm.engine.async_llm import RequestStream
from minivllm.entrypoints.openai.errors import APIError
from minivllm.entrypoints.openai.protocol import ChatCompletionRequest
from minivllm.entrypoints.openai.serving_engine import (
    ENGINE_ERRORS,
    SSE_DONE,
    ClientDisconnected,
    EventStreamResponse,
    OpenAIServing,
    close_all,
    collect,
    engine_error,
    finite,
    new_request_id,
    sse,
    sse_error,
    sse_usage,
    top_entries,
    unless_disconnected,
    usage,
)
from minivllm.entrypoints.openai.tool_calls import ToolPlan, plan_tools, read_calls
from minivllm.outputs import CompletionOutput, Logprob
from minivllm.sampling_params import SamplingParams


class OpenAIServingChat(OpenAIServing):
    async def prepare(
        self, request: ChatCompletionRequest
    ) -> tuple[ToolPlan, str, list[int], SamplingParams]:
        """What a chat request runs: its tool plan, the rendered prompt, its token ids and
        the sampling params (checked against the context and the request limits)."""
        tools = plan_tools(request, self.state.tool_call_parser)
        prompt_text = await self.render(
            request.messages, request.add_generation_prompt, tools.tools
        )
        prompt_ids = await self.tokenize_text(prompt_text, "messages", add_special_tokens=False)
        max_tokens = self.check_length(len(prompt_ids), request.requested_max_tokens, "messages")
        if request.top_logprobs and not request.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        top_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        self.check_request_size([len(prompt_ids)], request.n, max_tokens, top_logprobs)
        params = self.sampling_params(request, max_tokens, top_logprobs)
        if tools.constraint is not None:
            params.structured_outputs = tools.constraint
        return tools, prompt_text, prompt_ids, params

    async def create(self, raw_request: Request) -> Response:
        request: ChatCompletionRequest = await self.parse(raw_request, ChatCompletionRequest)
        model = self.check_model(request.model)
        tools, prompt_text, prompt_ids, params = await self.prepare(request)
        top_logprobs = params.logprobs
        request_id = new_request_id("chatcmpl")
        prompt = {"prompt_token_ids": prompt_ids, "prompt": prompt_text}
        streams = await self.start([prompt], [params], request_id, request.cache_salt, raw_request)
        meta = {"id": request_id, "created": int(time.time()), "model": model}
        if request.stream:
            body = self._stream(request, meta, streams[0], tools)
            return EventStreamResponse(body, streams)
        try:
            output = await unless_disconnected(raw_request, collect(streams[0]))
        except ClientDisconnected:
            return Response(status_code=499)
        except ENGINE_ERRORS as exc:
            raise engine_error(exc) from None
        finally:
            close_all(streams)
        choices = []
        for c in output.outputs:
            message, finish_reason = _message(tools, c)
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": self._logprobs(c, top_logprobs)
                    if top_logprobs is not None
                    else None,
                    "finish_reason": finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        num_completion_tokens = sum(len(c.token_ids) for c in output.outputs)
        body = {
            **meta,
            "object": "chat.completion",
            "choices": choices,
            "usage": usage(len(prompt_ids), num_completion_tokens),
        }
        return JSONResponse(body)

    async def _stream(
        self,
        request: ChatCompletionRequest,
        meta: dict[str, Any],
        stream: RequestStream,
        tools: ToolPlan,
    ) -> AsyncIterator[str]:
        """Text deltas as tokens arrive; with tool calls possible (any tool mode but
        "none"), each choice's reply is held back and sent whole when it finishes, since a
        call is only known once its text is complete."""
        holding = tools.mode != "none"
        held: dict[int, list[str]] = {}
        meta = {**meta, "object": "chat.completion.chunk"}
        top_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        num_prompt_tokens = num_completion_tokens = 0
        try:
            for index in range(request.n):
                delta = {"role": "assistant", "content": ""}
                yield sse({**meta, "choices": [_chunk_choice(index, delta, None, None)]})
            async for output in stream:
                num_prompt_tokens = len(output.prompt_token_ids)
                for c in output.outputs:
                    if not c.token_ids and c.finish_reason is None:
                        continue
                    num_completion_tokens += len(c.token_ids)
                    logprobs = self._logprobs(c, top_logprobs) if top_logprobs is not None else None
                    if holding:
                        held.setdefault(c.index, []).append(c.text)
                        if c.finish_reason is None:
                            continue
                        whole = _copy_text(c, "".join(held.pop(c.index)))
                        message, finish_reason = _message(tools, whole)
                        delta = {k: v for k, v in message.items() if k != "role"}
                        if delta.get("tool_calls"):
                            delta["tool_calls"] = [
                                {"index": i, **call} for i, call in enumerate(delta["tool_calls"])
                            ]
                        choice = _chunk_choice(c.index, delta, logprobs, c)
                        choice["finish_reason"] = finish_reason
                        yield sse({**meta, "choices": [choice]})
                        continue
                    if not c.text and logprobs is None and c.finish_reason is None:
                        continue  # tokens that are not text yet (a partial UTF-8 character)
                    choice = _chunk_choice(c.index, {"content": c.text}, logprobs, c)
                    yield sse({**meta, "choices": [choice]})
            if request.include_usage:
                yield sse_usage(meta, num_prompt_tokens, num_completion_tokens)
        except ENGINE_ERRORS as exc:
            yield sse_error(exc)
        yield SSE_DONE

    def _logprobs(self, completion: CompletionOutput, k: int) -> dict[str, Any]:
        content = []
        for token_id, entry in zip(completion.token_ids, completion.logprobs or []):
            item = self._token_logprob(token_id, entry[token_id])
            item["top_logprobs"] = [
                self._token_logprob(tid, lp) for tid, lp in top_entries(entry, k)
            ]
            content.append(item)
        return {"content": content}

    def _token_logprob(self, token_id: int, logprob: Logprob) -> dict[str, Any]:
        token = (
            logprob.decoded_token
            if logprob.decoded_token is not None
            else self.decode_token(token_id)
        )
        return {
            "token": token,
            "logprob": finite(logprob.logprob),
            "bytes": list(token.encode("utf-8")),
        }


def _chunk_choice(
    index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None, c: CompletionOutput | None
) -> dict[str, Any]:
    return {
        "index": index,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": c.finish_reason if c else None,
        "stop_reason": c.stop_reason if c else None,
    }


def _message(tools: ToolPlan, c: CompletionOutput) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a finished choice, and its finish_reason."""
    content, calls = read_calls(tools, c.text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if not calls:
        return message, c.finish_reason
    message["tool_calls"] = calls
    # a forced call ends as OpenAI ends one ("stop"); a chosen or required one as "tool_calls"
    return message, "stop" if tools.mode == "named" else "tool_calls"


def _copy_text(c: CompletionOutput, text: str) -> CompletionOutput:
    whole = copy.copy(c)
    whole.text = text
    return whole
