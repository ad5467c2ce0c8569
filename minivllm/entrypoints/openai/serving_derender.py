"""`POST /v1/chat/completions/derender` and `/v1/completions/derender` (vLLM's
scale-out routes): a complete tokens-mode answer of `/inference/v1/generate` back
to the ChatCompletion or Completion the ordinary route gives.

The text comes from the engine's own detokenizer with the original request's stop
strings and special-token setting, so it is the text generation would have
reported; logprobs and tool calls are then written by the ordinary routes' code.
"""

from __future__ import annotations

import asyncio
import time

from starlette.requests import Request
from starlette.responses import JSONResponse

from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.entrypoints.openai.errors import APIError, from_value_error
from minivllm.entrypoints.openai.protocol import ChatCompletionRequest, SamplingRequest
from minivllm.entrypoints.openai.protocol_scale_out import (
    DerenderChatRequest,
    DerenderCompletionRequest,
    GenerateLogProbsContent,
    GenerateTokensChoice,
    GenerateTokensResponse,
)
from minivllm.entrypoints.openai.serving_chat import OpenAIServingChat, _message
from minivllm.entrypoints.openai.serving_completion import OpenAIServingCompletion, _Logprobs
from minivllm.entrypoints.openai.serving_engine import OpenAIServing, ServerState, usage
from minivllm.entrypoints.openai.tool_calls import ToolPlan, plan_tools
from minivllm.outputs import CompletionOutput, Logprob
from minivllm.sampling_params import MAX_LOGPROBS, SamplingParams


class OpenAIServingDerender(OpenAIServing):
    def __init__(self, state: ServerState) -> None:
        super().__init__(state)
        self.chat = OpenAIServingChat(state)
        self.completions = OpenAIServingCompletion(state)

    async def derender_chat(self, raw_request: Request) -> JSONResponse:
        """`chat_request` (the body given to render) brings stop strings, logprob counts
        and tools; without it the output is decoded plainly."""
        request: DerenderChatRequest = await self.parse(raw_request, DerenderChatRequest)
        _refuse_streaming(request.stream)
        model = self.check_model(request.model)
        chat, gen = request.chat_request, request.generate_response
        self._check_answers(
            {"generate_response": gen}, {"prompt_token_ids": request.prompt_token_ids}
        )
        tools = (
            plan_tools(chat, self.state.tool_call_parser) if chat else ToolPlan("none", None, None)
        )
        top_logprobs = _chat_top_logprobs(chat)
        (outputs,) = await self._decode([gen], _text_params(chat))
        choices = []
        for c in outputs:
            message, finish_reason = _message(tools, c)
            logprobs = None
            if top_logprobs is not None and c.logprobs is not None:
                logprobs = self.chat._logprobs(c, top_logprobs)
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        num_completion_tokens = sum(len(c.token_ids) for c in outputs)
        body = {
            "id": gen.request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": usage(request.prompt_tokens or 0, num_completion_tokens),
        }
        return JSONResponse(body)

    async def derender_completion(self, raw_request: Request) -> JSONResponse:
        """One answer per prompt, in render's order; choices are numbered across them."""
        request: DerenderCompletionRequest = await self.parse(
            raw_request, DerenderCompletionRequest
        )
        _refuse_streaming(request.stream)
        model = self.check_model(request.model)
        original = request.completion_request
        if original is not None and original.echo:
            raise APIError(400, "echo is not supported by derender", "completion_request")
        gens = request.generate_responses
        prompt_ids = request.prompt_token_ids or []
        self._check_answers(
            {f"generate_responses[{i}]": gen for i, gen in enumerate(gens)},
            {f"prompt_token_ids[{i}]": ids for i, ids in enumerate(prompt_ids)},
        )
        k = original.logprobs if original else MAX_LOGPROBS
        outputs = [c for cs in await self._decode(gens, _text_params(original)) for c in cs]
        choices = []
        for index, c in enumerate(outputs):
            logprobs = None
            if k is not None and c.logprobs is not None:
                logprobs = _Logprobs()
                self.completions._append_logprobs(logprobs, c.token_ids, c.logprobs, k, 0)
            choices.append(
                {
                    "index": index,
                    "text": c.text,
                    "logprobs": logprobs.as_dict() if logprobs else None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        body = {
            "id": gens[0].request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": usage(
                sum(request.prompt_tokens or []), sum(len(c.token_ids) for c in outputs)
            ),
        }
        return JSONResponse(body)

    async def _decode(
        self, gens: list[GenerateTokensResponse], params: SamplingParams
    ) -> list[list[CompletionOutput]]:
        """Every answer's choices as the engine reported them, decoded off the event loop."""
        return await asyncio.to_thread(
            lambda: [[self._completion(choice, params) for choice in gen.choices] for gen in gens]
        )

    def _completion(self, choice: GenerateTokensChoice, params: SamplingParams) -> CompletionOutput:
        """The engine's detokenizer drops a stop token and cuts at a stop string as it did
        while generating; a stop string it finds ends the choice with "stop"."""
        token_ids = list(choice.token_ids or [])
        stop_terminated = choice.finish_reason == "stop" and isinstance(choice.stop_reason, int)
        detokenizer = IncrementalDetokenizer(self.tokenizer, params)
        stop = detokenizer.update(token_ids, stop_terminated, finished=True)
        finish_reason, stop_reason = choice.finish_reason, choice.stop_reason
        if stop is not None:
            finish_reason, stop_reason = "stop", stop
        logprobs = None
        if choice.logprobs is not None and choice.logprobs.content is not None:
            logprobs = [self._logprob_entry(entry) for entry in choice.logprobs.content]
        text = detokenizer.output_text
        return CompletionOutput(
            choice.index, text, token_ids, None, logprobs, finish_reason, stop_reason
        )

    def _logprob_entry(self, entry: GenerateLogProbsContent) -> dict[int, Logprob]:
        """Back to the engine's form, token id -> Logprob, decoded as the engine decodes."""
        decoded = {
            top.token_id: Logprob(top.logprob, top.rank, self.decode_token(top.token_id))
            for top in entry.top_logprobs
        }
        decoded[entry.token_id] = Logprob(
            entry.logprob, entry.rank, self.decode_token(entry.token_id)
        )
        return decoded

    def _check_answers(
        self,
        gens: dict[str, GenerateTokensResponse],
        prompt_ids: dict[str, list[int] | None],
    ) -> None:
        """Before anything is decoded, the bounds the request models cannot know: each
        choice within the context and the vocabulary, logprobs matching their tokens,
        and no more tokens in all than one request may generate here."""
        num_tokens = num_logprobs = 0
        for param, gen in gens.items():
            for i, choice in enumerate(gen.choices):
                num_tokens += len(choice.token_ids or [])
                content = choice.logprobs.content if choice.logprobs else None
                num_logprobs += sum(1 + len(entry.top_logprobs) for entry in content or [])
                self._check_choice(choice, f"{param}.choices[{i}]", param)
        logprob_limit = self.state.limits.logprobs_per_request(self.state.max_model_len)
        if num_logprobs > logprob_limit:
            raise APIError(
                400,
                f"these answers hold {num_logprobs} log-probabilities, more than this "
                f"server's limit of {logprob_limit} (--max-logprobs-per-request)",
                next(iter(gens)),
            )
        limit = self.state.limits.max_tokens_per_request
        if num_tokens > limit:
            raise APIError(
                400,
                f"these answers hold {num_tokens} tokens, more than this server's limit of "
                f"{limit} per request (--max-tokens-per-request); derender fewer at a time",
                next(iter(gens)),
            )
        answers_prompt_ids = {f"{p}.prompt_token_ids": g.prompt_token_ids for p, g in gens.items()}
        for param, ids in {**prompt_ids, **answers_prompt_ids}.items():
            if ids is not None:
                self._check_within_context(ids, param, param)

    def _check_choice(self, choice: GenerateTokensChoice, where: str, param: str) -> None:
        token_ids = choice.token_ids or []
        if not token_ids:
            raise APIError(400, f"{where}.token_ids is empty: nothing to derender", param)
        self._check_within_context(token_ids, f"{where}.token_ids", param)
        content = choice.logprobs.content if choice.logprobs else None
        if content is None:
            return
        if [entry.token_id for entry in content] != token_ids:
            raise APIError(
                400, f"{where}.logprobs.content must have one entry per token of token_ids", param
            )
        for entry in content:
            self.check_token_ids([top.token_id for top in entry.top_logprobs], f"{where}.logprobs")

    def _check_within_context(self, token_ids: list[int], where: str, param: str) -> None:
        limit = self.state.max_model_len
        if len(token_ids) > limit:
            raise APIError(
                400, f"{where} has {len(token_ids)} tokens, over max_model_len {limit}", param
            )
        self.check_token_ids(token_ids, where)


def _text_params(request: SamplingRequest | None) -> SamplingParams:
    """What decides an output's text: stop strings and special tokens, as generated."""
    if request is None:
        return SamplingParams(max_tokens=None)
    try:
        return SamplingParams(
            max_tokens=None,
            stop=request.stop,
            min_tokens=request.min_tokens,
            skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
        )
    except (ValueError, TypeError) as exc:
        raise from_value_error(exc) from None


def _chat_top_logprobs(chat: ChatCompletionRequest | None) -> int | None:
    """How many alternatives the chat route would list (None: no logprobs); without the
    original request, all the answer carries."""
    if chat is None:
        return MAX_LOGPROBS
    return (chat.top_logprobs or 0) if chat.logprobs else None


def _refuse_streaming(stream: bool) -> None:
    if stream:
        raise APIError(
            400,
            "streaming derender (one call per generate chunk) is not supported; derender "
            "the complete generate answer (stream=false)",
            "stream",
        )
