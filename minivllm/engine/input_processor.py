"""Prompts in, validated token ids out: every request is checked before it reaches the core."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from minivllm.config import ModelConfig
from minivllm.sampling_params import SamplingParams

PromptType = str | Mapping[str, Any]


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


class InputProcessor:
    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer, config.trust_remote_code)
        self._grammars = None  # a GrammarBackend, built on the first constrained request

    def process(self, prompt: PromptType, params: SamplingParams) -> tuple[str | None, list[int]]:
        text, token_ids = self._tokenize(prompt)
        self._validate(token_ids, params)
        return text, token_ids

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids
                ):
                    raise TypeError("prompt_token_ids must be a list of integers")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
        raise TypeError(
            f"a prompt is a str or a dict with 'prompt_token_ids' (TokensPrompt), got {type(prompt).__name__}"
        )

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty (0 tokens)")
        vocab = self.config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]} is out of vocabulary (valid: 0..{vocab - 1})"
            )
        max_len = self.config.max_model_len
        if len(token_ids) > max_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, longer than the maximum model length {max_len}"
            )
        if params.structured_outputs is not None:
            self._check_grammar(params)
        for token_id in list(params.stop_token_ids or []) + list((params.logit_bias or {}).keys()):
            if not 0 <= token_id < vocab:
                raise ValueError(
                    f"token id {token_id} in sampling params is out of vocabulary (0..{vocab - 1})"
                )

    def _check_grammar(self, params: SamplingParams) -> None:
        """Compile the request's grammar here, so a bad schema is the caller's ValueError
        (HTTP 400) rather than a failure inside the engine's step."""
        from minivllm.structured_output.backend import GrammarBackend

        if self._grammars is None:
            self._grammars = GrammarBackend(
                self.tokenizer, self.config.vocab_size, list(self.config.eos_token_ids)
            )
        self._grammars.compiled(params.structured_outputs)
