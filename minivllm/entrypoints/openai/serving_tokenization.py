"""`POST /tokenize` and `POST /detokenize` (vLLM's routes)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from minivllm.entrypoints.openai.errors import APIError
from minivllm.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from minivllm.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    """Renders messages exactly as chat does, so `/tokenize` counts what chat would send."""

    async def tokenize(self, raw_request: Request) -> dict[str, Any]:
        request: TokenizeRequest = await self.parse(raw_request, TokenizeRequest)
        self.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        if request.messages is not None:
            text = self.render(request.messages, request.add_generation_prompt)
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
        else:
            ids = self.tokenizer(
                request.prompt, add_special_tokens=request.add_special_tokens
            ).input_ids
        return {"count": len(ids), "max_model_len": self.state.max_model_len, "tokens": list(ids)}

    async def detokenize(self, raw_request: Request) -> dict[str, Any]:
        request: DetokenizeRequest = await self.parse(raw_request, DetokenizeRequest)
        self.check_model(request.model)
        vocab_size = len(self.tokenizer)
        bad = next((t for t in request.tokens if t >= vocab_size), None)
        if bad is not None:
            raise APIError(
                400, f"token id {bad} is out of vocabulary (0..{vocab_size - 1})", "tokens"
            )
        return {"prompt": self.tokenizer.decode(request.tokens)}
