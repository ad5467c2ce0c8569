"""Request bodies of the OpenAI-compatible API, with explicit bounds on every field.

Responses are plain dicts built in the serving modules (OpenAI's field names).
Types are strict (`"stream": "yes"`, `"prompt": [true]` and `"n": "2"` are 400s, not
coerced). Unknown fields are ignored, as OpenAI and vLLM do, except the ones this
server knows and does not support (`UNSUPPORTED`): those are refused by name unless
they carry their no-op value, so a client never gets a silently different answer.
Limits that depend on the model or the operator (prompt characters, sequences and
tokens per request, logprob values per response) are checked in the serving code;
docs/limits.md lists them all.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
)

from minivllm.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_TOKEN_ID = 2**31 - 1  # tokenizers index with 32-bit ids; a larger id is no token
MAX_CACHE_SALT_CHARS = 128
MAX_N = 128
MAX_PROMPTS = 256
MAX_STOP = 64
MAX_TOOLS = 128
StopString = Annotated[str, StringConstraints(min_length=1, max_length=1024)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
Prompt = (
    str
    | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
    | list[TokenId]
    | Annotated[list[list[TokenId]], Field(min_length=1, max_length=MAX_PROMPTS)]
)
StopStrings = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)]


class Body(BaseModel):
    """A request body (or part of one): strict types, unknown fields ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)


# Fields of OpenAI's or vLLM's requests that this server does not implement, with the
# values that mean "not used" (None always does). Anything else is refused by name.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "suffix": ("",),
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "prompt_logprobs": (),
    "truncate_prompt_tokens": (),
    "priority": (0,),
    "logits_processors": (),
    "functions": (),
    "function_call": (),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
    "kv_transfer_params": (),
    "mm_processor_kwargs": (),
}


def refuse_unsupported(value: Any, info: ValidationInfo) -> Any:
    """A field validator for the `UNSUPPORTED` fields: ValueError unless a no-op value."""
    no_ops = UNSUPPORTED[info.field_name]
    if value is not None and not any(value == v and type(value) is type(v) for v in no_ops):
        raise ValueError("not supported by this server; leave it out")
    return value


def check_cache_salt(salt: str | None) -> str | None:
    """vLLM's rule (GHSA-wpww-v874-ph2p): None, or a non-empty string of at most 128
    characters without '@', '/', backslash or NUL (separators in cache keys and paths)."""
    if salt is None:
        return None
    if not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        raise ValueError(f"must have 1 to {MAX_CACHE_SALT_CHARS} characters")
    if any(c in salt for c in "@/\\\x00"):
        raise ValueError("may not contain '@', '/', '\\' or NUL")
    return salt


class StreamOptions(Body):
    include_usage: bool = False


class JsonSchemaFormat(Body):
    name: str = Field("response", max_length=256)
    description: str | None = Field(None, max_length=4096)
    json_schema: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# vLLM's guided_decoding_backend values this server answers to (it has xgrammar only)
GRAMMAR_BACKENDS = ("xgrammar", "auto")


class SamplingRequest(Body):
    """Fields completions and chat share: OpenAI's, then vLLM's extras."""

    model: str | None = Field(None, max_length=1024)
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: StopStrings | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, max_length=1024
    )
    user: str | None = Field(None, max_length=256)
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=1024)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    spaces_between_special_tokens: bool = True
    # vLLM v0.30: false opts this request out of the server's watermark
    watermarking: bool | None = None
    # structured output: OpenAI's response_format, vLLM's structured_outputs and guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = Field(None, max_length=64)

    # known but not implemented (`UNSUPPORTED`): refused unless they say "not used"
    best_of: Any = None
    suffix: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    prompt_logprobs: Any = None
    truncate_prompt_tokens: Any = None
    priority: Any = None
    logits_processors: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    kv_transfer_params: Any = None
    mm_processor_kwargs: Any = None

    _refuse_unsupported = field_validator(*UNSUPPORTED)(refuse_unsupported)

    @field_validator("cache_salt")
    @classmethod
    def _cache_salt(cls, salt: str | None) -> str | None:
        return check_cache_salt(salt)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one constraint this request names (ValueError naming the fields when it
        names several, or a schema-less json_schema)."""
        named = {}
        if self.response_format is not None and self.response_format.type != "text":
            if self.response_format.type == "json_object":
                named["response_format"] = {"json_object": True}
            else:
                fmt = self.response_format.json_schema
                if fmt is None or fmt.json_schema is None:
                    raise ValueError("response_format json_schema needs json_schema.schema")
                named["response_format"] = {"json": fmt.json_schema}
        if self.structured_outputs is not None:
            named["structured_outputs"] = dict(self.structured_outputs)
        for field, key in (
            ("guided_json", "json"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
        ):
            if getattr(self, field) is not None:
                named[field] = {key: getattr(self, field)}
        if self.guided_decoding_backend not in (None, *GRAMMAR_BACKENDS):
            raise ValueError(
                f"guided_decoding_backend {self.guided_decoding_backend!r} is not available; "
                "this server constrains output with xgrammar"
            )
        if not named:
            return None
        if len(named) > 1:
            raise ValueError(f"give one output constraint, not {', '.join(named)}")
        ((field, values),) = named.items()
        unknown = set(values) - {"json", "regex", "choice", "grammar", "json_object"}
        if unknown:
            raise ValueError(f"{field} has unknown keys {sorted(unknown)}")
        try:
            return StructuredOutputsParams(**values)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{field}: {e}") from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def to_sampling_params(
        self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """Raises ValueError/TypeError naming the field, as `SamplingParams` does."""
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self._logit_bias(),
            watermarking=self.watermarking,
            structured_outputs=self.structured_outputs_params(),
        )

    def _logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        try:
            return {int(k): v for k, v in self.logit_bias.items()}
        except ValueError:
            raise ValueError("logit_bias keys must be token ids (integers as strings)") from None


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    # 0 with echo=true: score the prompt (its logprobs), generate nothing (as vLLM)
    max_tokens: int | None = Field(16, ge=0, le=INT64_MAX)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False


class TextPart(Body):
    type: Literal["text"]
    text: str


class ToolCallFunction(Body):
    name: str = Field(..., max_length=256)
    arguments: str = Field("", max_length=1_000_000)


class ToolCall(Body):
    id: str = Field(..., max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(None, max_length=256)

    @property
    def num_chars(self) -> int:
        """Characters of the message's text, tool calls included (the prompt-size bound)."""
        if isinstance(self.content, list):
            num = sum(len(part.text) for part in self.content)
        else:
            num = len(self.content or "")
        for call in self.tool_calls or []:
            num += len(call.function.name) + len(call.function.arguments)
        return num

    def to_template_dict(self) -> dict[str, Any]:
        """String content, as chat templates expect it (text parts joined by newlines);
        a tool call's arguments as an object where they parse (templates print them)."""
        if isinstance(self.content, list):
            content = "\n".join(part.text for part in self.content)
        else:
            content = self.content or ""
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": _maybe_json(call)},
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _maybe_json(call: ToolCall) -> Any:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


class FunctionDefinition(Body):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = Field(None, max_length=8192)
    parameters: dict | None = None
    strict: bool | None = None


class ChatTool(Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(Body):
    name: str = Field(..., max_length=64)


class NamedToolChoice(Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=4096)
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(Body):
    """Either `prompt` (text) or `messages` (a conversation, through the chat template)."""

    model: str | None = Field(None, max_length=1024)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=4096)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(Body):
    model: str | None = Field(None, max_length=1024)
    tokens: list[TokenId] = Field(..., max_length=1_000_000)


class WatermarkDetectRequest(Body):
    """`POST /v1/watermark/detect`: a completion's `text` (tokenized without special
    tokens) or its `token_ids`, never the prompt."""

    model: str | None = Field(None, max_length=1024)
    text: str | None = None
    token_ids: list[TokenId] | None = Field(None, max_length=1_000_000)
    p_value_threshold: float = Field(0.01, gt=0.0, lt=1.0)
    # dual key: the weight of key B (default: the server's alpha)
    alpha: float | None = Field(None, ge=0.0, le=1.0)
