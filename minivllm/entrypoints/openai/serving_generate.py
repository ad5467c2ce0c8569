"""`POST /inference/v1/generate` (vLLM's scale-out route): token ids in, token ids or text out.

A gateway that tokenized the prompt itself (or asked `/render` to) sends the
`GenerateRequest`; the answer is a `GenerateTokensResponse` (`output_mode`
"tokens": token ids, logprobs by token id) or a `GenerateTextResponse` ("text":
the detokenized text too, logprobs as chat completions give them), whole or as
server-sent chunks.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from minivllm.engine.async_llm import RequestStream
from minivllm.entrypoints.openai.errors import APIError, from_value_error
from minivllm.entrypoints.openai.protocol_scale_out import GenerateRequest
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
    sse,
    sse_error,
    unless_disconnected,
    usage,
)
from minivllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from minivllm.sampling_params import SamplingParams


class OpenAIServingGenerate(OpenAIServing):
    async def generate(self, raw_request: Request) -> Response:
        request: GenerateRequest = await self.parse(raw_request, GenerateRequest)
        model = self.check_model(request.model)
        self.check_token_ids(request.token_ids, "token_ids")
        params = self._params(request)
        request_id = f"generate-tokens-{request.request_id}"
        prompt = {"prompt_token_ids": list(request.token_ids)}
        streams = await self.start([prompt], [params], request_id, request.cache_salt, raw_request)
        if request.stream:
            return EventStreamResponse(self._stream(request, request_id, streams[0]), streams)
        try:
            output = await unless_disconnected(raw_request, collect(streams[0]))
        except ClientDisconnected:
            return Response(status_code=499)
        except ENGINE_ERRORS as exc:
            raise engine_error(exc) from None
        finally:
            close_all(streams)
        return JSONResponse(self._response(request, request_id, model, output))

    def _params(self, request: GenerateRequest) -> SamplingParams:
        body = request.sampling_params
        if body.watermarking is False and self.state.watermark_enforce:
            raise APIError(
                400,
                "this server watermarks every output (--watermark-enforce); requests may not "
                "opt out: remove 'watermarking': false",
                "sampling_params",
            )
        if request.output_mode == "text" and not body.detokenize:
            raise APIError(
                400, 'output_mode "text" needs sampling_params.detokenize true', "output_mode"
            )
        max_tokens = self.check_length(len(request.token_ids), body.max_tokens, "token_ids")
        logprobs = body.logprobs
        if body.prompt_logprobs is not None:  # charged as echoed prompt logprobs are
            logprobs = max(logprobs or 0, body.prompt_logprobs)
        self.check_request_size(
            [len(request.token_ids)],
            body.n,
            max_tokens,
            logprobs,
            echo_logprobs=body.prompt_logprobs is not None,
        )
        try:
            return body.to_params(max_tokens)
        except (ValueError, TypeError) as exc:
            raise from_value_error(exc) from None

    def _response(
        self, request: GenerateRequest, request_id: str, model: str, output: RequestOutput
    ) -> dict[str, Any]:
        text_mode = request.output_mode == "text"
        choices = []
        for c in output.outputs:
            choice = self._choice(c, text_mode, request.sampling_params.logprobs is not None)
            choice["finish_reason"] = c.finish_reason or "stop"  # vLLM's default
            choices.append(choice)
        num_completion_tokens = sum(len(c.token_ids) for c in output.outputs)
        return {
            "request_id": request_id,
            "output_mode": request.output_mode,
            "model": model,
            "created": int(time.time()),
            "usage": usage(len(output.prompt_token_ids), num_completion_tokens),
            "prompt_logprobs": self._prompt_logprobs(output.prompt_logprobs),
            "prompt_token_ids": output.prompt_token_ids if request.return_token_ids else None,
            "choices": choices,
        }

    async def _stream(
        self, request: GenerateRequest, request_id: str, stream: RequestStream
    ) -> AsyncIterator[str]:
        """One chunk per choice and step that has something new (tokens, text held back
        for a stop string, or the finish), then the usage chunk if asked for."""
        text_mode = request.output_mode == "text"
        wants_logprobs = request.sampling_params.logprobs is not None
        meta = {"request_id": request_id, "output_mode": request.output_mode}
        num_prompt_tokens = 0
        num_tokens: dict[int, int] = {}
        pending_prompt_ids: list[int] | None = None
        first = True
        try:
            async for output in stream:
                if first:
                    first = False
                    num_prompt_tokens = len(output.prompt_token_ids)
                    if request.return_token_ids:
                        pending_prompt_ids = output.prompt_token_ids
                for c in output.outputs:
                    num_tokens[c.index] = num_tokens.get(c.index, 0) + len(c.token_ids)
                    if not (c.token_ids or c.finish_reason or (text_mode and c.text)):
                        continue
                    chunk: dict[str, Any] = {
                        **meta,
                        "choices": [self._choice(c, text_mode, wants_logprobs)],
                        "usage": usage(num_prompt_tokens, num_tokens[c.index])
                        if request.continuous_usage
                        else None,
                    }
                    if pending_prompt_ids is not None:
                        chunk["prompt_token_ids"], pending_prompt_ids = pending_prompt_ids, None
                    yield sse(chunk)
            if request.include_usage:
                total = usage(num_prompt_tokens, sum(num_tokens.values()))
                yield sse({**meta, "choices": [], "usage": total})
        except ENGINE_ERRORS as exc:
            yield sse_error(exc)
        yield SSE_DONE

    def _choice(self, c: CompletionOutput, text_mode: bool, wants_logprobs: bool) -> dict[str, Any]:
        logprobs = None
        if wants_logprobs:
            entries = c.logprobs or []
            if text_mode:
                logprobs = {
                    "content": [self._text_logprob(t, e) for t, e in zip(c.token_ids, entries)]
                }
            else:
                logprobs = {"content": [_token_logprob(t, e) for t, e in zip(c.token_ids, entries)]}
        choice: dict[str, Any] = {
            "index": c.index,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
            "token_ids": list(c.token_ids),
        }
        if text_mode:
            choice["text"] = c.text
        choice["logprobs"] = logprobs
        return choice

    def _text_logprob(self, token_id: int, entry: dict[int, Logprob]) -> dict[str, Any]:
        """Chat completions' shape: decoded token, its UTF-8 bytes, the candidates."""
        candidates = [self._text_candidate(tid, lp) for tid, lp in ranked(entry, token_id)]
        chosen = candidates[0] if token_id in entry else self._text_candidate(token_id, None)
        return {**chosen, "top_logprobs": candidates}

    def _text_candidate(self, token_id: int, logprob: Logprob | None) -> dict[str, Any]:
        token = logprob.decoded_token if logprob and logprob.decoded_token is not None else None
        token = self.decode_token(token_id) if token is None else token
        return {
            "token": token,
            "logprob": _clamp(logprob.logprob) if logprob else _clamp(-math.inf),
            "bytes": list(token.encode("utf-8", errors="replace")),
        }

    def _prompt_logprobs(self, entries: PromptLogprobs | None) -> list[Any] | None:
        """vLLM's shape: per prompt position None or {token id: {logprob, rank, decoded_token}}."""
        if entries is None:
            return None
        return [
            None
            if entry is None
            else {
                str(tid): {
                    "logprob": _clamp(lp.logprob),
                    "rank": lp.rank,
                    "decoded_token": lp.decoded_token,
                }
                for tid, lp in entry.items()
            }
            for entry in entries
        ]


def ranked(entry: dict[int, Logprob], chosen: int) -> list[tuple[int, Logprob]]:
    """The candidates of one position as vLLM lists them: the chosen token first, then
    the rest by rank."""
    rest = sorted(
        ((tid, lp) for tid, lp in entry.items() if tid != chosen),
        key=lambda item: math.inf if item[1].rank is None else item[1].rank,
    )
    return ([(chosen, entry[chosen])] if chosen in entry else []) + rest


def _token_logprob(token_id: int, entry: dict[int, Logprob]) -> dict[str, Any]:
    """The tokens-mode shape: ids only (the caller holds the tokenizer)."""
    candidates = [_id_candidate(tid, lp) for tid, lp in ranked(entry, token_id)]
    chosen = candidates[0] if token_id in entry else _id_candidate(token_id, None)
    return {**chosen, "top_logprobs": candidates}


def _id_candidate(token_id: int, logprob: Logprob | None) -> dict[str, Any]:
    if logprob is None:
        return {"token_id": token_id, "logprob": _clamp(-math.inf), "rank": None}
    return {"token_id": token_id, "logprob": _clamp(logprob.logprob), "rank": logprob.rank or None}


def _clamp(logprob: float) -> float:
    """JSON has neither -inf nor NaN: both become the logprob floor."""
    return finite(-math.inf if math.isnan(logprob) else logprob)
