"""Request bodies of the OpenAI-compatible API, with explicit bounds on every field.

Responses are plain dicts built in the serving modules (OpenAI's field names).
Unknown fields are ignored, as OpenAI and vLLM do.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from minivllm.sampling_params import MAX_LOGPROBS, SamplingParams

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 128
MAX_PROMPTS = 256
MAX_STOP = 64
StopString = Annotated[str, StringConstraints(min_length=1, max_length=1024)]
TokenId = Annotated[int, Field(ge=0)]
Prompt = (
    str
    | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
    | list[TokenId]
    | Annotated[list[list[TokenId]], Field(min_length=1, max_length=MAX_PROMPTS)]
)
StopStrings = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields completions and chat share: OpenAI's, then vLLM's extras."""

    model_config = ConfigDict(extra="ignore")

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
    top_k: int | None = Field(None, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=1024)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    # vLLM v0.30: false opts this request out of the server's watermark
    watermarking: bool | None = None

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
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self._logit_bias(),
            watermarking=self.watermarking,
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
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=256)

    def to_template_dict(self) -> dict[str, str]:
        """String content, as chat templates expect it (text parts joined by newlines)."""
        if isinstance(self.content, list):
            content = "\n".join(part.text for part in self.content)
        else:
            content = self.content or ""
        message = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=4096)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(BaseModel):
    """Either `prompt` (text) or `messages` (a conversation, through the chat template)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, max_length=1024)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=4096)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, max_length=1024)
    tokens: list[TokenId] = Field(..., max_length=1_000_000)


class WatermarkDetectRequest(BaseModel):
    """`POST /v1/watermark/detect`: a completion's `text` (tokenized without special
    tokens) or its `token_ids`, never the prompt."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, max_length=1024)
    text: str | None = None
    token_ids: list[TokenId] | None = Field(None, max_length=1_000_000)
    p_value_threshold: float = Field(0.01, gt=0.0, lt=1.0)
    # dual key: the weight of key B (default: the server's alpha)
    alpha: float | None = Field(None, ge=0.0, le=1.0)
