"""The model runner's side: one grammar matcher per constrained request."""

from __future__ import annotations

import logging
from typing import Any

import torch

from minivllm.structured_output.backend import GrammarBackend, _xgrammar
from minivllm.worker.request_state import CachedRequestState

logger = logging.getLogger("minivllm")


class StructuredOutputManager:
    """Matchers follow their requests' tokens: created when a request arrives (replaying
    any output it already has, as after a preemption), fed every token sampled, dropped
    when it leaves. `bitmask` gives the rows' allowed tokens for the sampler."""

    def __init__(
        self,
        tokenizer_path: str,
        vocab_size: int,
        trust_remote_code: bool,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.trust_remote_code = trust_remote_code
        self._backend: GrammarBackend | None = None
        # request -> (its matcher, the mask its rows also take, or None)
        self.matchers: dict[str, tuple[Any, torch.Tensor | None]] = {}

    @property
    def backend(self) -> GrammarBackend:
        if self._backend is None:  # the tokenizer is read once, on the first such request
            from minivllm.engine.input_processor import load_tokenizer

            tokenizer = load_tokenizer(self.tokenizer_path, self.trust_remote_code)
            self._backend = GrammarBackend(tokenizer, self.vocab_size, self.eos_token_ids)
        return self._backend

    def add(self, state: CachedRequestState) -> None:
        params = state.sampling_params.structured_outputs
        if params is None:
            return
        matcher = _xgrammar().GrammarMatcher(self.backend.compiled(params))
        for token in state.output_token_ids:
            matcher.accept_token(token)
        self.matchers[state.req_id] = (matcher, self.backend.extra_mask(params))

    def remove(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self.matchers.pop(req_id, None)

    def bitmask(self, states: list[CachedRequestState]) -> torch.Tensor | None:
        """[rows, ceil(V / 32)] int32, bit t of a row set where token t is allowed (all
        set on unconstrained rows); None when no row is constrained."""
        rows = [(i, self.matchers.get(s.req_id)) for i, s in enumerate(states)]
        rows = [(i, entry) for i, entry in rows if entry is not None]
        if not rows:
            return None
        mask = _xgrammar().allocate_token_bitmask(len(states), self.vocab_size)
        for i, (matcher, extra) in rows:
            if matcher.is_terminated():  # finished, but still running (ignore_eos)
                mask[i] = self.backend.eos_only_mask
                continue
            matcher.fill_next_token_bitmask(mask, i)
            if extra is not None:
                mask[i] &= extra
        return mask

    def accept(self, states: list[CachedRequestState], emitted: list[list[int]]) -> None:
        for state, tokens in zip(states, emitted):
            entry = self.matchers.get(state.req_id)
            if entry is None:
                continue
            matcher = entry[0]
            for token in tokens:
                if matcher.is_terminated():
                    break  # the stop token that ended the grammar; the request ends with it
                if not matcher.accept_token(token):
                    logger.warning(
                        "request %s: token %d is outside its grammar", state.req_id, token
                    )
                    break
