"""Request bodies of the scale-out routes (vLLM's field names), with explicit bounds.

`/v1/*/render` returns a `GenerateRequest` (prompt tokens plus sampling params),
`/inference/v1/generate` takes one, and `/v1/*/derender` takes the tokens-mode
response of generate (`GenerateTokensResponse`) back to an OpenAI response.
Bounds that depend on the model (vocabulary size, context length) are checked
by the serving code; unknown fields are ignored, as elsewhere in the API.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from minivllm.entrypoints.openai.protocol import (
    INT64_MAX,
    INT64_MIN,
    MAX_N,
    MAX_PROMPTS,
    Body,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    StopStrings,
    TokenId,
)
from minivllm.sampling_params import (
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    MAX_LOGPROBS,
    SamplingParams,
    StructuredOutputsParams,
)

MAX_TOKEN_IDS = 1_000_000  # per list; the server's max_model_len is checked after parsing
# printable ASCII without spaces: request ids end up in logs and in engine request ids
RequestId = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[!-~]+$")]
# an answer's id: generate's prefix plus a request id
AnswerId = Annotated[str, Field(min_length=1, max_length=512, pattern=r"^[!-~]+$")]
ModelName = Annotated[str | None, Field(max_length=1024)]
TokenIds = Annotated[list[TokenId], Field(max_length=MAX_TOKEN_IDS)]
FiniteLogprob = Annotated[float, Field(allow_inf_nan=False)]


def new_generate_id() -> str:
    return uuid.uuid4().hex


_Body = Body  # strict types, unknown fields ignored (as the server's other request bodies)


def _refusing(unsupported: dict[str, str]) -> Any:
    """A before-validator: ValueError naming the first of `unsupported` that is set
    (not null, not empty), with the reason this server lacks it."""

    def refuse(data: Any) -> Any:
        if isinstance(data, dict):
            for name, reason in unsupported.items():
                if data.get(name) not in (None, [], {}):
                    raise ValueError(f"{name} is not supported by this server ({reason})")
        return data

    return model_validator(mode="before")(refuse)


class GenerateStructuredOutputs(_Body):
    """vLLM's `StructuredOutputsParams`, the constraints this server compiles (xgrammar)."""

    # a JSON schema (object or text); `json` on the wire
    json_schema: dict | str | None = Field(None, alias="json")
    regex: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)
    choice: list[Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)]] | None = Field(
        None, max_length=MAX_CHOICES
    )
    grammar: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)
    json_object: bool | None = None

    _refuse = _refusing({"structural_tag": "xgrammar JSON, regex, choice and grammar only"})

    def to_params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(
            json=self.json_schema,
            regex=self.regex,
            choice=self.choice,
            grammar=self.grammar,
            json_object=self.json_object,
        )


class GenerateSamplingParams(_Body):
    """vLLM's `SamplingParams` as JSON: its field names, with this server's bounds
    (those of /v1/completions). vLLM fields that would change the output and that
    this engine lacks are refused by name when set, never silently dropped;
    bookkeeping fields (`output_kind`, `extra_args`, ...) are ignored."""

    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(0, ge=-1, le=INT64_MAX)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: StopStrings | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=1024)
    ignore_eos: bool = False
    # None: as much as the context leaves (vLLM's default for this route)
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # JSON object keys are strings: token ids as "5", as render writes them
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, max_length=1024
    )
    watermarking: bool | None = None
    structured_outputs: GenerateStructuredOutputs | None = None

    _refuse = _refusing(
        {
            "allowed_token_ids": "use logit_bias",
            "bad_words": "no bad-words filter",
            "logprob_token_ids": "logprobs are the top-k",
            "prompt_logprob_token_ids": "prompt logprobs are the top-k",
            "thinking_token_budget": "no reasoning parser",
            "repetition_detection": "no repetition detection",
        }
    )

    @classmethod
    def from_params(cls, params: SamplingParams) -> GenerateSamplingParams:
        """The JSON form of params a route has already resolved (render's output)."""
        so = params.structured_outputs
        return cls(
            n=params.n,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p,
            seed=params.seed,
            stop=list(params.stop) or None,
            stop_token_ids=list(params.stop_token_ids) or None,
            ignore_eos=params.ignore_eos,
            max_tokens=params.max_tokens,
            min_tokens=params.min_tokens,
            logprobs=params.logprobs,
            prompt_logprobs=params.prompt_logprobs,
            detokenize=params.detokenize,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output,
            logit_bias=None
            if params.logit_bias is None
            else {str(k): v for k, v in params.logit_bias.items()},
            watermarking=params.watermarking,
            structured_outputs=None
            if so is None
            else GenerateStructuredOutputs.model_validate(
                {k: getattr(so, k) for k in ("json", "regex", "choice", "grammar", "json_object")}
            ),
        )

    def to_params(self, max_tokens: int) -> SamplingParams:
        """Raises ValueError/TypeError naming the field, as `SamplingParams` does."""
        return SamplingParams(
            n=self.n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            detokenize=self.detokenize,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.logit_bias,
            watermarking=self.watermarking,
            structured_outputs=None
            if self.structured_outputs is None
            else self.structured_outputs.to_params(),
        )


class GenerateStreamOptions(_Body):
    include_usage: bool | None = False
    # usage on every chunk, not only in the final one
    continuous_usage_stats: bool | None = False


class GenerateRequest(_Body):
    """`POST /inference/v1/generate`: tokens in; tokens (or text) out."""

    request_id: RequestId = Field(default_factory=new_generate_id)
    token_ids: TokenIds = Field(..., min_length=1)
    sampling_params: GenerateSamplingParams
    model: ModelName = None
    output_mode: Literal["tokens", "text"] = "tokens"
    # prompt_token_ids in the response (in the first chunk when streaming)
    return_token_ids: bool | None = None
    stream: bool | None = False
    stream_options: GenerateStreamOptions | None = None
    cache_salt: str | None = None
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)

    _refuse = _refusing(
        {
            "features": "no multimodal models",
            "content_parts": "no multimodal models",
            "kv_transfer_params": "no KV connector",
            "ec_transfer_params": "no encoder-cache connector",
        }
    )

    @field_validator("cache_salt")
    @classmethod
    def _salt_as_the_server_checks_it(cls, value: str | None) -> str | None:
        """One rule for salts: the one /v1/completions and /v1/chat/completions apply."""
        try:
            SamplingRequest.model_validate({"cache_salt": value})
        except ValidationError as exc:
            error = exc.errors(include_input=False)[0]
            raise ValueError(str(error.get("ctx", {}).get("error") or error["msg"])) from None
        return value

    @field_validator("priority")
    @classmethod
    def _no_priorities(cls, value: int) -> int:
        if value != 0:  # vLLM refuses priorities too unless its scheduler is set to use them
            raise ValueError("priority must be 0: this server schedules first come, first served")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class GenerateLogProb(_Body):
    token_id: TokenId
    logprob: FiniteLogprob
    rank: int | None = Field(None, ge=1)


class GenerateLogProbsContent(GenerateLogProb):
    """The chosen token at one position, then every candidate the engine returned
    (the chosen one first, then by rank)."""

    top_logprobs: list[GenerateLogProb] = Field([], max_length=MAX_LOGPROBS + 1)


class GenerateLogProbs(_Body):
    content: list[GenerateLogProbsContent] | None = Field(None, max_length=MAX_TOKEN_IDS)


class GenerateTokensChoice(_Body):
    index: int = Field(..., ge=0, lt=MAX_N)
    finish_reason: Literal["stop", "length", "abort"] | None = "stop"
    # the stop string or stop token id that ended the output (None: EOS, length, abort)
    stop_reason: TokenId | Annotated[str, Field(max_length=1024)] | None = None
    token_ids: TokenIds | None = None
    logprobs: GenerateLogProbs | None = None


class GenerateTokensResponse(_Body):
    """What derender reads: a complete `output_mode="tokens"` answer of generate."""

    request_id: AnswerId = Field(default_factory=new_generate_id)
    output_mode: Literal["tokens"] = "tokens"
    model: ModelName = None
    created: int | None = Field(None, ge=0, le=INT64_MAX)
    prompt_token_ids: TokenIds | None = None
    choices: list[GenerateTokensChoice] = Field(..., max_length=MAX_N)


class DerenderChatRequest(_Body):
    """`POST /v1/chat/completions/derender`: a tokens-mode generate answer back to a
    ChatCompletion. `chat_request` (the body given to /render) supplies stop strings,
    logprob counts and tools; without it the output is plain decoded text."""

    stream: bool = False
    model: ModelName = None
    generate_response: GenerateTokensResponse
    # usage.prompt_tokens (the generate answer counts only its output)
    prompt_tokens: int | None = Field(None, ge=0, le=MAX_TOKEN_IDS)
    # accepted for vLLM's clients; this engine's text never depends on the prompt
    prompt_token_ids: TokenIds | None = None
    chat_request: ChatCompletionRequest | None = None


class DerenderCompletionRequest(_Body):
    """`POST /v1/completions/derender`: one tokens-mode generate answer per prompt
    (parallel to the list /v1/completions/render returned) back to a Completion."""

    stream: bool = False
    model: ModelName = None
    generate_responses: list[GenerateTokensResponse] = Field(
        ..., min_length=1, max_length=MAX_PROMPTS
    )
    prompt_tokens: list[Annotated[int, Field(ge=0, le=MAX_TOKEN_IDS)]] | None = Field(
        None, max_length=MAX_PROMPTS
    )
    prompt_token_ids: list[TokenIds | None] | None = Field(None, max_length=MAX_PROMPTS)
    completion_request: CompletionRequest | None = None

    @model_validator(mode="after")
    def _parallel_lists(self) -> DerenderCompletionRequest:
        for name in ("prompt_tokens", "prompt_token_ids"):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.generate_responses):
                raise ValueError(
                    f"{name} needs one entry per generate response "
                    f"({len(self.generate_responses)}), got {len(values)}"
                )
        return self
