"""`POST /tokenize` and `POST /detokenize` (vLLM's routes)."""

from __future__ import annotations

import asyncio
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
            text = await self.render(request.messages, request.add_generation_prompt)
            ids = await self.tokenize_text(text, "messages", add_special_tokens=False)
        else:
            ids = await self.tokenize_text(request.prompt, "prompt", request.add_special_tokens)
        return {"count": len(ids), "max_model_len": self.state.max_model_len, "tokens": ids}

    async def detokenize(self, raw_request: Request) -> dict[str, Any]:
        request: DetokenizeRequest = await self.parse(raw_request, DetokenizeRequest)
        self.check_model(request.model)
        self.check_token_ids(request.tokens, "tokens")
        return {"prompt": await asyncio.to_thread(self.tokenizer.decode, request.tokens)}
