"""The `VllmEngine` servicer: vLLM's gRPC RPCs over the HTTP server's `AsyncLLM`, state and checks.

Requests pass the same gates as `/v1/completions`: availability (draining, dead
engine, a full queue), the character bound before tokenizing, the vocabulary and
context-length checks, the server's request limits, `SamplingParams`' own
validation and the engine's prompt checks; every refusal is a gRPC status with a
bounded message. A client that cancels its call aborts the request.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from minivllm.engine.async_llm import EngineDeadError, RequestStream
from minivllm.entrypoints.grpc.errors import StatusError, invalid, unsupported
from minivllm.entrypoints.grpc.loads import LoadReporter
from minivllm.entrypoints.grpc.responses import chunk, complete, input_logprobs
from minivllm.entrypoints.grpc.sampling import to_sampling_params
from minivllm.entrypoints.grpc.tokenizer_bundle import TokenizerBundle, chunks
from minivllm.entrypoints.openai.errors import APIError, from_value_error
from minivllm.entrypoints.openai.serving_engine import (
    ENGINE_ERRORS,
    OpenAIServing,
    ServerState,
    collect,
    new_request_id,
)
from minivllm.metrics import EngineMetrics
from minivllm.outputs import PromptLogprobs
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger("minivllm")
MAX_REQUEST_ID_CHARS = 256
_FLUSH_POLL_SECONDS = 0.05
Context = grpc.aio.ServicerContext


class VllmEngineServicer(pb_grpc.VllmEngineServicer):
    """Every RPC of `vllm.grpc.engine.VllmEngine`; those minivllm has no capability for
    (embeddings, a profiler, KV events) answer UNIMPLEMENTED."""

    def __init__(self, state: ServerState, metrics: EngineMetrics) -> None:
        self.state = state
        self.async_llm = state.async_llm
        self.checks = OpenAIServing(state)  # the HTTP server's availability and length checks
        engine = state.async_llm.engine
        self.loads = LoadReporter(engine, metrics)
        self.tokenizer_bundle = TokenizerBundle(engine.config.model.tokenizer)
        self.model_info = _model_info(state)
        self.start_time = time.time()
        self.last_receive_time = 0.0

    # ------------------------------------------------------------ generation

    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.last_receive_time = time.time()
        try:
            stream, params = await self._start(request)
        except StatusError as error:
            await context.abort(error.code, error.message)
            return
        try:
            outputs = (
                self._stream(stream, params) if request.stream else self._whole(stream, params)
            )
            async for response in outputs:
                yield response
        except ENGINE_ERRORS as exc:
            code = grpc.StatusCode.UNAVAILABLE
            if not isinstance(exc, EngineDeadError):
                code = grpc.StatusCode.INTERNAL
            await context.abort(code, str(exc))
        finally:
            stream.close()  # aborts the request if it has not finished (a cancelled call)

    async def _start(self, request: pb.GenerateRequest) -> tuple[RequestStream, SamplingParams]:
        _refuse_unsupported(request)
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise invalid(f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters")
        sampling = request.sampling_params
        try:
            self.checks.check_available()
            prompt_ids = await self._prompt_ids(request)
            self.checks.check_token_ids(prompt_ids, "tokenized.input_ids")
            requested = sampling.max_tokens if sampling.HasField("max_tokens") else None
            max_tokens = self.checks.check_length(len(prompt_ids), requested, "prompt")
            params = to_sampling_params(sampling, max_tokens)
            self._check_size(len(prompt_ids), params)
            request_id = request.request_id or new_request_id("grpc")
            prompt = {"prompt_token_ids": prompt_ids}
            (stream,) = await self.checks.start([prompt], [params], request_id, None)
        except APIError as error:
            raise StatusError.from_api_error(error) from None
        except (ValueError, TypeError) as exc:
            raise StatusError.from_api_error(from_value_error(exc)) from None
        return stream, params

    async def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        """The prompt's ids: given, or `text` tokenized off the event loop once it passes
        the server's character bound (`--max-prompt-chars`); then `truncate_prompt_tokens`."""
        kind = request.WhichOneof("input")
        if kind == "tokenized":
            prompt_ids = list(request.tokenized.input_ids)
        elif kind == "text":
            self.checks.check_chars(len(request.text), "text")
            tokenizer, text = self.state.tokenizer, request.text
            prompt_ids = await asyncio.to_thread(lambda: list(tokenizer(text).input_ids))
        else:
            raise invalid("the request has no prompt: set tokenized.input_ids or text")
        sampling = request.sampling_params
        if not sampling.HasField("truncate_prompt_tokens"):
            return prompt_ids
        keep = sampling.truncate_prompt_tokens
        keep = self.state.max_model_len if keep == -1 else keep
        if keep < 1:
            raise invalid("truncate_prompt_tokens must be -1 (the context length) or >= 1")
        return prompt_ids[-keep:]

    def _check_size(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """The server's per-request limits; prompt logprobs count as echoed ones do on HTTP."""
        assert params.max_tokens is not None
        echo = params.prompt_logprobs is not None
        logprobs = max(params.logprobs or 0, params.prompt_logprobs or 0)
        self.checks.check_request_size(
            [num_prompt_tokens],
            params.n,
            params.max_tokens,
            logprobs if echo or params.logprobs is not None else None,
            echo_logprobs=echo,
        )

    async def _stream(
        self, stream: RequestStream, params: SamplingParams
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Each sample's new ids as they come (none for a step that made none), its
        complete when it finishes; the prompt's logprobs ride on each sample's first chunk."""
        prompt_logprobs: PromptLogprobs = []
        started: set[int] = set()
        async for output in stream:
            prompt_logprobs += output.prompt_logprobs or []
            for completion in output.outputs:
                if completion.token_ids:
                    inputs = None
                    if completion.index not in started:
                        started.add(completion.index)
                        inputs = input_logprobs(
                            prompt_logprobs, output.prompt_token_ids, params.prompt_logprobs
                        )
                    yield chunk(output, completion, params.logprobs, inputs)
                if completion.finish_reason is not None:
                    yield complete(output, completion, params.logprobs)

    async def _whole(
        self, stream: RequestStream, params: SamplingParams
    ) -> AsyncIterator[pb.GenerateResponse]:
        """One complete per sample, with all its ids and logprobs, once every sample finished."""
        output = await collect(stream)
        inputs = input_logprobs(
            output.prompt_logprobs, output.prompt_token_ids, params.prompt_logprobs
        )
        for completion in output.outputs:
            yield complete(output, completion, params.logprobs, inputs)

    async def Abort(self, request: pb.AbortRequest, context: Context) -> pb.AbortResponse:
        """Abort these requests (ids this server does not run are ignored, as vLLM does);
        each one's call ends with a complete whose finish reason is "abort"."""
        for request_id in request.request_ids:
            self.async_llm.abort(request_id)
        return pb.AbortResponse()

    # ------------------------------------------------------------ state

    async def HealthCheck(
        self, request: pb.HealthCheckRequest, context: Context
    ) -> pb.HealthCheckResponse:
        healthy, message = self.health()
        return pb.HealthCheckResponse(healthy=healthy, message=message)

    def health(self) -> tuple[bool, str]:
        """Unhealthy once the engine has died or the server drains, as `GET /health`."""
        if self.async_llm.dead_error is not None:
            return False, f"the engine has stopped: {self.async_llm.dead_error}"
        if self.state.is_draining:
            return False, "the server is shutting down"
        return True, "healthy"

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: Context
    ) -> pb.GetModelInfoResponse:
        return self.model_info

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: Context
    ) -> pb.GetServerInfoResponse:
        config = self.async_llm.engine.config
        return pb.GetServerInfoResponse(
            active_requests=self.async_llm.num_active_requests,
            is_paused=False,
            last_receive_timestamp=self.last_receive_time,
            uptime_seconds=time.time() - self.start_time,
            server_type="vllm-grpc",
            data_parallel_size=1,
            kv_cache_dtype=config.cache.cache_dtype,
            block_size=config.cache.block_size,
            attention_backend=config.attention_backend or "",
            model_dtype=str(config.model.dtype),
            max_num_seqs=config.scheduler.max_num_seqs,
            # no reasoning parser: a grammar constrains the output from its first token
            constrained_decoding_start="first_token",
        )

    async def GetLoads(self, request: pb.GetLoadsRequest, context: Context) -> pb.GetLoadsResponse:
        """One rank; `dp_rank` and `include` are accepted and not applied, as vLLM does."""
        return self.loads.loads()

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: Context
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        try:
            data, sha256 = await self.tokenizer_bundle.archive()
        except OSError as exc:
            logger.warning("GetTokenizer: %s", exc)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            return
        for message in chunks(data, sha256):
            yield message

    async def FlushCache(
        self, request: common_pb2.FlushCacheRequest, context: Context
    ) -> common_pb2.FlushCacheResponse:
        """Drop the prefix cache once no request runs: at once (`timeout_s` 0: refused while
        requests run), or as soon as the engine is idle within `timeout_s` seconds."""
        timeout = request.timeout_s
        if not math.isfinite(timeout) or timeout < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "timeout_s must be >= 0")
        deadline = time.monotonic() + timeout
        while not await self.async_llm.reset_prefix_cache():
            if timeout == 0:
                return common_pb2.FlushCacheResponse(
                    success=False, message="requests are running; the prefix cache was kept"
                )
            if time.monotonic() >= deadline:
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"requests were still running after {timeout:g} s; the prefix cache was kept",
                )
            await asyncio.sleep(_FLUSH_POLL_SECONDS)
        return common_pb2.FlushCacheResponse(success=True, message="prefix cache flushed")

    # ------------------------------------------------------------ capabilities minivllm lacks

    async def Embed(self, request: pb.EmbedRequest, context: Context) -> pb.EmbedResponse:
        await _abort_unsupported(
            context, "Embed: minivllm serves generative models, not embeddings"
        )

    async def StartProfile(
        self, request: common_pb2.StartProfileRequest, context: Context
    ) -> common_pb2.ProfileResponse:
        await _abort_unsupported(context, "StartProfile: minivllm has no engine profiler")

    async def StopProfile(
        self, request: common_pb2.StopProfileRequest, context: Context
    ) -> common_pb2.ProfileResponse:
        await _abort_unsupported(context, "StopProfile: minivllm has no engine profiler")

    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: Context
    ) -> None:
        await _abort_unsupported(
            context, "SubscribeKvEvents: minivllm publishes no KV cache events"
        )


async def _abort_unsupported(context: Context, message: str) -> None:
    error = unsupported(message)
    await context.abort(error.code, error.message)


def _refuse_unsupported(request: pb.GenerateRequest) -> None:
    if request.HasField("mm_inputs") or request.extra_mm_inputs or request.HasField("media_refs"):
        raise unsupported("multimodal input is not supported: minivllm serves text models")
    if request.HasField("kv_transfer_params") or request.HasField("kv_transfer_params_json"):
        raise unsupported(
            "KV transfer (prefill/decode disaggregation) is not supported by minivllm"
        )
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise invalid(f"data_parallel_rank {request.data_parallel_rank} does not exist: 1 rank")


def _model_info(state: ServerState) -> pb.GetModelInfoResponse:
    config = state.async_llm.engine.config.model
    hf_config = config.hf_config
    return pb.GetModelInfoResponse(
        model_path=config.model,
        is_generation=True,
        max_context_length=state.max_model_len,
        vocab_size=config.vocab_size,
        supports_vision=False,
        served_model_name=state.model_name,
        tokenizer_path=config.tokenizer,
        model_type=getattr(hf_config, "model_type", "") or "",
        architectures=list(getattr(hf_config, "architectures", None) or []),
        eos_token_ids=sorted(config.eos_token_ids),
        pad_token_id=_token_id(hf_config, "pad_token_id"),
        bos_token_id=_token_id(hf_config, "bos_token_id"),
        # the longest prompt accepted: at least one token must be generated
        max_req_input_len=state.max_model_len - 1,
    )


def _token_id(hf_config: object, name: str) -> int:
    """One id from the HF config, 0 when it has none (as vLLM's servicer reports it)."""
    value = getattr(hf_config, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
