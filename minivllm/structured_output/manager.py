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
        self.matchers: dict[str, Any] = {}
        self.json_requests: set[str] = set()  # compact JSON: no raw control characters

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
        self.matchers[state.req_id] = matcher
        if params.key()[0] in ("json", "json_object"):
            self.json_requests.add(state.req_id)

    def remove(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self.matchers.pop(req_id, None)
            self.json_requests.discard(req_id)

    def bitmask(self, states: list[CachedRequestState]) -> torch.Tensor | None:
        """[rows, ceil(V / 32)] int32, bit t of a row set where token t is allowed (all
        set on unconstrained rows); None when no row is constrained."""
        rows = [(i, self.matchers.get(s.req_id)) for i, s in enumerate(states)]
        rows = [(i, m) for i, m in rows if m is not None]
        if not rows:
            return None
        xgr = _xgrammar()
        mask = xgr.allocate_token_bitmask(len(states), self.vocab_size)
        for i, matcher in rows:
            if matcher.is_terminated():  # finished, but still running (ignore_eos): EOS only
                mask[i] = 0
                for token in self.eos_token_ids:
                    mask[i, token // 32] |= _bit(token % 32)
            else:
                matcher.fill_next_token_bitmask(mask, i)
                if states[i].req_id in self.json_requests:
                    mask[i] &= self.backend.no_control_mask
        return mask

    def accept(self, states: list[CachedRequestState], emitted: list[list[int]]) -> None:
        for state, tokens in zip(states, emitted):
            matcher = self.matchers.get(state.req_id)
            if matcher is None:
                continue
            for token in tokens:
                if matcher.is_terminated():
                    break  # the stop token that ended the grammar; the request ends with it
                if not matcher.accept_token(token):
                    logger.warning(
                        "request %s: token %d is outside its grammar", state.req_id, token
                    )
                    break


def _bit(position: int) -> int:
    """Bit `position` of an int32 word (bit 31 is the sign bit)."""
    return (1 << position) - (1 << 32 if position == 31 else 0)
