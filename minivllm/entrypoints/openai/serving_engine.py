"""What completions and chat share: model names, prompt checks, starting requests, SSE, logprobs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import StreamingResponse

from minivllm.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    EngineStepError,
    QueueFullError,
    RequestStream,
)
from minivllm.entrypoints.openai.errors import (
    APIError,
    bounded,
    error_body,
    from_validation_error,
    from_value_error,
)
from minivllm.entrypoints.openai.limits import ServerLimits
from minivllm.entrypoints.openai.protocol import ChatMessage, SamplingRequest
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.sampling_params import SamplingParams

# JSON has no -inf: a token the model rules out entirely gets this floor (vLLM's choice).
_MIN_LOGPROB = -9999.0


@dataclass
class ServerState:
    """What every route needs: the engine, its tokenizer and the server's settings."""

    async_llm: AsyncLLM
    tokenizer: Any
    served_model_names: list[str]
    max_model_len: int
    chat_template: str | None = None
    tool_call_parser: str | None = None
    # refuse requests that opt out of the watermark (`--watermark-enforce`)
    watermark_enforce: bool = False
    limits: ServerLimits = field(default_factory=ServerLimits)
    is_draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def max_prompt_chars(self) -> int:
        return self.limits.prompt_chars(self.max_model_len)


class OpenAIServing:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.tokenizer = state.tokenizer

    async def parse(self, raw_request: Request, model: type[BaseModel]) -> Any:
        """The JSON body validated into `model`; a bounded 400 otherwise."""
        body = await raw_request.body()
        try:
            return model.model_validate_json(body or b"{}")
        except ValidationError as exc:
            raise from_validation_error(exc, model) from None

    async def render(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The conversation as prompt text, through `--chat-template` or the tokenizer's
        template; off the event loop, after the character bound."""
        num_chars = sum(m.num_chars for m in messages)
        self.check_chars(num_chars, "messages")
        return await asyncio.to_thread(self._render, messages, add_generation_prompt, tools)

    def _render(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None,
    ) -> str:
        template = self.state.chat_template
        if template is None and not getattr(self.tokenizer, "chat_template", None):
            raise APIError(
                400,
                "this model's tokenizer has no chat template; start the server with "
                "--chat-template FILE, or use /v1/completions",
                "messages",
            )
        try:
            return self.tokenizer.apply_chat_template(
                [m.to_template_dict() for m in messages],
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                tools=tools,
            )
        except Exception as exc:  # jinja raises many kinds; all mean "bad messages"
            raise APIError(
                400, f"the chat template failed on these messages: {bounded(str(exc))}", "messages"
            ) from None

    def check_chars(self, num_chars: int, param: str) -> None:
        limit = self.state.max_prompt_chars
        if num_chars > limit:
            raise APIError(
                400,
                f"the prompt has {num_chars} characters, more than this server's limit of "
                f"{limit} (it cannot fit {self.state.max_model_len} tokens of context); "
                "shorten it (the operator sets the limit with --max-prompt-chars)",
                param,
            )

    async def tokenize_text(
        self, text: str, param: str, add_special_tokens: bool = True
    ) -> list[int]:
        """Token ids of `text`, tokenized off the event loop once the character bound holds
        (a 15 MB prompt once blocked the whole server, /health too, for ~25 s)."""
        self.check_chars(len(text), param)
        return await asyncio.to_thread(
            lambda: list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
        )

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        """400 for an id outside the vocabulary, before anything decodes it."""
        vocab_size = len(self.tokenizer)
        bad = next((t for t in token_ids if t >= vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is out of vocabulary (0..{vocab_size - 1})", param)

    def check_request_size(
        self,
        prompt_lengths: list[int],
        n: int,
        max_tokens: int,
        logprobs: int | None,
        echo_logprobs: bool = False,
    ) -> None:
        """The request's sequences, tokens and logprob values against `ServerLimits`."""
        limits = self.state.limits
        num_seqs = len(prompt_lengths) * n
        if num_seqs > limits.max_sequences_per_request:
            raise APIError(
                400,
                f"this request starts {num_seqs} sequences ({len(prompt_lengths)} prompts x "
                f"n={n}), more than this server's limit of {limits.max_sequences_per_request} "
                "(--max-sequences-per-request); split it",
                "n",
            )
        if num_seqs * max_tokens > limits.max_tokens_per_request:
            raise APIError(
                400,
                f"this request may generate {num_seqs * max_tokens} tokens ({num_seqs} "
                f"sequences x max_tokens={max_tokens}), more than this server's limit of "
                f"{limits.max_tokens_per_request} (--max-tokens-per-request); lower max_tokens "
                "or n, or split it",
                "max_tokens",
            )
        if logprobs is not None:
            per_seq = [max_tokens + (length if echo_logprobs else 0) for length in prompt_lengths]
            values = n * sum(per_seq) * (1 + logprobs)
            limit = limits.logprobs_per_request(self.state.max_model_len)
            if values > limit:
                raise APIError(
                    400,
                    f"this response would carry {values} log-probabilities, more than this "
                    f"server's limit of {limit} "
                    "(--max-logprobs-per-request); ask for fewer logprobs, tokens or sequences",
                    "logprobs",
                )

    def check_model(self, name: str | None) -> str:
        """The served name to report; 404 for a name this server does not serve."""
        if name is None or name in self.state.served_model_names:
            return name or self.state.model_name
        raise APIError(404, f"The model `{name}` does not exist.", "model")

    def check_available(self) -> None:
        if self.state.is_draining or self.state.async_llm.dead_error is not None:
            raise APIError(503, "the server is shutting down or its engine has stopped")

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, param: str) -> int:
        """The `max_tokens` to use; 400 when the prompt (plus the tokens asked for) cannot fit."""
        limit = self.state.max_model_len
        if num_prompt_tokens >= limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens, but the prompt has "
                f"{num_prompt_tokens} tokens; a prompt may have at most {limit - 1} "
                "(at least one token must be generated).",
                param,
            )
        if max_tokens is None:
            return limit - num_prompt_tokens
        if num_prompt_tokens + max_tokens > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens, but {max_tokens + num_prompt_tokens} "
                f"were requested ({num_prompt_tokens} in the prompt, max_tokens={max_tokens}); "
                f"lower max_tokens to at most {limit - num_prompt_tokens} or shorten the prompt.",
                "max_tokens",
            )
        return max_tokens

    def sampling_params(
        self,
        request: SamplingRequest,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        if request.watermarking is False and self.state.watermark_enforce:
            raise APIError(
                400,
                "this server watermarks every output (--watermark-enforce); requests may not "
                "opt out: remove 'watermarking': false",
                "watermarking",
            )
        try:
            return request.to_sampling_params(max_tokens, logprobs, prompt_logprobs)
        except (ValueError, TypeError) as exc:
            raise from_value_error(exc) from None

    async def start(
        self,
        prompts: list[dict[str, Any]],
        params: list[SamplingParams],
        request_id: str,
        cache_salt: str | None,
        raw_request: Request | None = None,
    ) -> list[RequestStream]:
        """Queue one engine request per prompt; if any is refused, abort the ones already queued.

        429 when the engine's queue cannot take the request's sequences; the sender (the
        peer address) is the engine's client, among which admission is shared fairly."""
        self.check_available()
        limit = self.state.limits.max_waiting_sequences
        client = raw_request.client if raw_request is not None else None
        client_id = client.host if client is not None else None
        streams: list[RequestStream] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(
                    await self.state.async_llm.add_request(
                        prompt, p, rid, cache_salt, client_id, max_waiting=limit
                    )
                )
        except QueueFullError as exc:
            close_all(streams)
            raise APIError(429, f"{exc} (--max-waiting-seqs)") from None
        except (ValueError, TypeError) as exc:
            close_all(streams)
            raise from_value_error(exc) from None
        except EngineDeadError as exc:
            close_all(streams)
            raise APIError(503, str(exc)) from None
        return streams

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def close_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.close()


class EventStreamResponse(StreamingResponse):
    """Server-sent events that close (abort, if unfinished) their request streams however the
    response ends: finished, failed, or the client gone, even before the first chunk was made."""

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.streams = streams

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close_all(self.streams)


def engine_error(exc: Exception) -> APIError:
    status = 503 if isinstance(exc, EngineDeadError) else 500
    return APIError(status, str(exc))


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_usage(meta: dict[str, Any], num_prompt_tokens: int, num_completion_tokens: int) -> str:
    """The final chunk of a stream that asked for usage: no choices, only the counts."""
    return sse({**meta, "choices": [], "usage": usage(num_prompt_tokens, num_completion_tokens)})


SSE_DONE = "data: [DONE]\n\n"
ENGINE_ERRORS = (EngineStepError, EngineDeadError)


def sse_error(exc: Exception) -> str:
    error = engine_error(exc)
    return sse(error_body(error.status, error.message, error.param))


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }


def finite(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, each tagged with its stream's index."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    output = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, output
    finally:
        for task in pending:
            task.cancel()


async def collect(stream: RequestStream) -> RequestOutput:
    """Fold a request's delta outputs into one cumulative output."""
    final: RequestOutput | None = None
    children: dict[int, CompletionOutput] = {}
    async for output in stream:
        if final is None:
            final = output
            final.prompt_logprobs = list(output.prompt_logprobs or []) or None
        elif output.prompt_logprobs:
            final.prompt_logprobs = (final.prompt_logprobs or []) + output.prompt_logprobs
        for delta in output.outputs:
            child = children.get(delta.index)
            if child is None:
                children[delta.index] = _copy_completion(delta)
                continue
            child.text += delta.text
            child.token_ids.extend(delta.token_ids)
            if delta.logprobs is not None:
                child.logprobs = (child.logprobs or []) + delta.logprobs
            child.cumulative_logprob = delta.cumulative_logprob
            child.finish_reason, child.stop_reason = delta.finish_reason, delta.stop_reason
        final.finished = output.finished
    assert final is not None, "a request stream ends with a finished output"
    final.outputs = [children[i] for i in sorted(children)]
    return final


def _copy_completion(c: CompletionOutput) -> CompletionOutput:
    logprobs = list(c.logprobs) if c.logprobs is not None else None
    return CompletionOutput(
        c.index,
        c.text,
        list(c.token_ids),
        c.cumulative_logprob,
        logprobs,
        c.finish_reason,
        c.stop_reason,
    )


async def until_disconnected(raw_request: Request) -> None:
    """Returns when the client goes away (the body has been read, so only `http.disconnect` is left)."""
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(raw_request: Request, work: Any) -> Any:
    """Run `work` (a coroutine); cancel it if the client disconnects first (its requests abort)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnected(raw_request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientDisconnected()


class ClientDisconnected(Exception):
    """The client left before its response was ready; there is no one to answer."""


def chosen_logprob(entry: dict[int, Logprob], token_id: int) -> float:
    return finite(entry[token_id].logprob)


def top_entries(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The top-k alternatives of one position, best first."""
    ranked = [
        (lp.rank, tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= k
    ]
    return [(tid, lp) for _, tid, lp in sorted(ranked, key=lambda item: item[0])]
