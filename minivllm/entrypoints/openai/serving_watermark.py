"""`POST /v1/watermark/detect`: does a completion carry this server's watermark?

The response never reveals the key: only the test's outcome (`score`, `p_value`,
`log10_p_value`, `z_score`, `num_scored_tokens`, `is_watermarked`). Work is bounded:
the body by the server's body limit, token ids by the request model, and scoring by
`MAX_SCORED_TOKENS` distinct contexts; tokenizing runs off the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request

from minivllm.entrypoints.openai.errors import APIError
from minivllm.entrypoints.openai.protocol import WatermarkDetectRequest
from minivllm.entrypoints.openai.serving_engine import OpenAIServing
from minivllm.watermark.detector import MAX_SCORED_TOKENS, detect


class OpenAIServingWatermark(OpenAIServing):
    async def detect(self, raw_request: Request) -> dict[str, Any]:
        config = self.state.async_llm.engine.config.watermark_config
        if config is None:
            raise APIError(404, "this server does not watermark (start it with --watermark-config)")
        request: WatermarkDetectRequest = await self.parse(raw_request, WatermarkDetectRequest)
        self.check_model(request.model)
        if (request.text is None) == (request.token_ids is None):
            raise APIError(400, "give exactly one of text or token_ids", "text")
        if request.text is not None:
            ids = await self.tokenize_text(request.text, "text", add_special_tokens=False)
        else:
            ids = request.token_ids
            self.check_token_ids(ids, "token_ids")
        result = await asyncio.to_thread(
            detect, ids, config, request.p_value_threshold, True, request.alpha, MAX_SCORED_TOKENS
        )
        return result.to_dict()
