"""`POST /v1/completions`: prompts as text or token ids, streamed or whole."""

from __future__ import annotations

import copy
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from minivllm.engine.async_llm import RequestStream
from minivllm.entrypoints.openai.errors import APIError
from minivllm.entrypoints.openai.protocol import CompletionRequest
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
    merge_streams,
    new_request_id,
    sse,
    sse_error,
    sse_usage,
    top_entries,
    unless_disconnected,
    usage,
)
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass
class _Prompt:
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)


@dataclass
class _Logprobs:
    """OpenAI's legacy completion logprobs: parallel lists, one entry per token."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, raw_request: Request) -> Response:
        request: CompletionRequest = await self.parse(raw_request, CompletionRequest)
        model = self.check_model(request.model)
        prompts = await self._prompts(request.prompt)
        wants_prompt_logprobs = request.echo and request.logprobs is not None
        if request.max_tokens == 0 and not request.echo:
            raise APIError(
                400,
                "max_tokens=0 generates nothing: it needs echo=true (prompt scoring)",
                "max_tokens",
            )
        # scoring: the engine samples one token, which the response leaves out
        max_tokens = 1 if request.max_tokens == 0 else request.max_tokens
        lengths = [len(p.token_ids) for p in prompts]
        self.check_request_size(
            lengths,
            request.n,
            max_tokens or self.state.max_model_len - min(lengths),
            request.logprobs,
            wants_prompt_logprobs,
        )
        params = [
            self.sampling_params(
                request,
                self.check_length(len(p.token_ids), max_tokens, "prompt"),
                request.logprobs,
                request.logprobs if wants_prompt_logprobs else None,
            )
            for p in prompts
        ]
        engine_prompts = [{"prompt_token_ids": p.token_ids, "prompt": p.text} for p in prompts]
        request_id = new_request_id("cmpl")
        streams = await self.start(
            engine_prompts, params, request_id, request.cache_salt, raw_request
        )
        meta = {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
        }
        if request.stream:
            return EventStreamResponse(self._stream(request, meta, prompts, streams), streams)
        try:
            outputs = await unless_disconnected(raw_request, _collect_all(streams))
        except ClientDisconnected:
            return Response(status_code=499)
        except ENGINE_ERRORS as exc:
            raise engine_error(exc) from None
        finally:
            close_all(streams)
        return JSONResponse(self._response(request, meta, prompts, outputs))

    async def _prompts(self, prompt: str | list[Any]) -> list[_Prompt]:
        items = [prompt] if isinstance(prompt, str) or _is_token_ids(prompt) else list(prompt)
        prompts = []
        for item in items:
            if isinstance(item, str):
                if not item:
                    raise APIError(400, "prompt is empty", "prompt")
                prompts.append(_Prompt(item, await self.tokenize_text(item, "prompt")))
            else:
                if not item:
                    raise APIError(400, "prompt is an empty list of token ids", "prompt")
                self.check_length(len(item), None, "prompt")  # before decoding it
                self.check_token_ids(item, "prompt")
                prompts.append(_Prompt(self.tokenizer.decode(item), list(item)))
        return prompts

    def _response(
        self,
        request: CompletionRequest,
        meta: dict[str, Any],
        prompts: list[_Prompt],
        outputs: list[RequestOutput],
    ) -> dict[str, Any]:
        choices = []
        num_completion_tokens = 0
        for i, (prompt, output) in enumerate(zip(prompts, outputs)):
            prompt.logprobs = list(output.prompt_logprobs or [])
            for completion in map(_scoring(request), output.outputs):
                num_completion_tokens += len(completion.token_ids)
                logprobs = None
                if request.logprobs is not None:
                    logprobs = _Logprobs()
                    offset = self._echo_logprobs(logprobs, prompt) if request.echo else 0
                    self._append_logprobs(
                        logprobs,
                        completion.token_ids,
                        completion.logprobs or [],
                        request.logprobs,
                        offset,
                    )
                choices.append(
                    {
                        "index": i * request.n + completion.index,
                        "text": (prompt.text if request.echo else "") + completion.text,
                        "logprobs": logprobs.as_dict() if logprobs else None,
                        "finish_reason": completion.finish_reason,
                        "stop_reason": completion.stop_reason,
                    }
                )
        num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
        return {
            **meta,
            "choices": choices,
            "usage": usage(num_prompt_tokens, num_completion_tokens),
        }

    async def _stream(
        self,
        request: CompletionRequest,
        meta: dict[str, Any],
        prompts: list[_Prompt],
        streams: list[RequestStream],
    ) -> AsyncIterator[str]:
        started: set[int] = set()
        offsets: dict[int, int] = {}
        num_prompt_tokens = num_completion_tokens = 0
        try:
            async for i, output in merge_streams(streams):
                prompt = prompts[i]
                prompt.logprobs.extend(output.prompt_logprobs or [])
                if i not in started:
                    started.add(i)
                    num_prompt_tokens += len(output.prompt_token_ids)
                for completion in map(_scoring(request), output.outputs):
                    if not completion.token_ids and completion.finish_reason is None:
                        continue
                    num_completion_tokens += len(completion.token_ids)
                    index = i * request.n + completion.index
                    first = index not in offsets
                    text = (prompt.text if request.echo and first else "") + completion.text
                    logprobs = None
                    if request.logprobs is not None:
                        logprobs = _Logprobs()
                        offset = offsets.get(index, 0)
                        if request.echo and first:
                            offset = self._echo_logprobs(logprobs, prompt)
                        offsets[index] = self._append_logprobs(
                            logprobs,
                            completion.token_ids,
                            completion.logprobs or [],
                            request.logprobs,
                            offset,
                        )
                    offsets.setdefault(index, 0)
                    if not text and logprobs is None and completion.finish_reason is None:
                        continue  # tokens that are not text yet (a partial UTF-8 character)
                    choice = {
                        "index": index,
                        "text": text,
                        "logprobs": logprobs.as_dict() if logprobs else None,
                        "finish_reason": completion.finish_reason,
                        "stop_reason": completion.stop_reason,
                    }
                    yield sse({**meta, "choices": [choice]})
            if request.include_usage:
                yield sse_usage(meta, num_prompt_tokens, num_completion_tokens)
        except ENGINE_ERRORS as exc:
            yield sse_error(exc)
        yield SSE_DONE

    def _echo_logprobs(self, logprobs: _Logprobs, prompt: _Prompt) -> int:
        """Prompt tokens first (the first has no logprob); returns the text offset after them."""
        offset = 0
        for position, token_id in enumerate(prompt.token_ids):
            entry = prompt.logprobs[position] if position < len(prompt.logprobs) else None
            token = self.decode_token(token_id)
            logprobs.tokens.append(token)
            logprobs.text_offset.append(offset)
            if entry is None or token_id not in entry:
                logprobs.token_logprobs.append(None)
                logprobs.top_logprobs.append(None)
            else:
                logprobs.token_logprobs.append(finite(entry[token_id].logprob))
                logprobs.top_logprobs.append(_top_dict(entry, token_id, None))
            offset += len(token)
        return offset

    def _append_logprobs(
        self,
        logprobs: _Logprobs,
        token_ids: list[int],
        entries: list[dict[int, Logprob]],
        k: int,
        offset: int,
    ) -> int:
        for token_id, entry in zip(token_ids, entries):
            token = self.decode_token(token_id)
            logprobs.tokens.append(token)
            logprobs.text_offset.append(offset)
            logprobs.token_logprobs.append(finite(entry[token_id].logprob))
            logprobs.top_logprobs.append(_top_dict(entry, token_id, k))
            offset += len(token)
        return offset


def _top_dict(entry: dict[int, Logprob], chosen: int, k: int | None) -> dict[str, float]:
    """The top-k alternatives by decoded text, plus the chosen token (vLLM's convention)."""
    ranked = top_entries(entry, len(entry) if k is None else k)
    top = {lp.decoded_token or "": finite(lp.logprob) for _, lp in ranked}
    chosen_lp = entry[chosen]
    top.setdefault(chosen_lp.decoded_token or "", finite(chosen_lp.logprob))
    return top


def _is_token_ids(prompt: list[Any]) -> bool:
    return all(isinstance(t, int) for t in prompt)


async def _collect_all(streams: list[RequestStream]) -> list[RequestOutput]:
    return [await collect(stream) for stream in streams]


def _scoring(request: CompletionRequest):
    """Identity, except under max_tokens=0: each completion without its one sampled token."""
    if request.max_tokens != 0:
        return lambda completion: completion

    def scored(completion: CompletionOutput) -> CompletionOutput:
        empty = copy.copy(completion)
        empty.text, empty.token_ids, empty.logprobs = "", [], []
        if completion.finish_reason is not None:
            empty.finish_reason, empty.stop_reason = "length", None
        return empty

    return scored
