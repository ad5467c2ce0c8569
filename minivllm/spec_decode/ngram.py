"""Prompt-lookup (n-gram) drafting: continue the sequence the way it continued before.

For the request's tokens so far (prompt and output), take the longest suffix of
n tokens, `min_n <= n <= max_n`, that also occurs earlier; among its earlier
occurrences take the first; propose the (up to) k tokens that followed it.
No match: no drafts. (Saxena 2023, "Prompt Lookup Decoding"; vLLM's `ngram` method.)
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from minivllm.spec_decode.proposer import Proposal, TargetHiddenStates
from minivllm.worker.request_state import CachedRequestState


class NgramProposer:
    uses_hidden_states = False

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.k = num_speculative_tokens
        self.min_n, self.max_n = min_n, max_n

    def propose(self, states: list[CachedRequestState], limits: list[int]) -> dict[str, Proposal]:
        proposals = {}
        for state, limit in zip(states, limits):
            drafts = self.propose_one(state.token_ids, limit)
            if drafts:
                proposals[state.req_id] = Proposal(drafts)
        return proposals

    def remove(self, req_ids: set[str]) -> None:
        return  # keeps no per-request state

    def observe_hidden_states(self, states: TargetHiddenStates) -> None:
        return  # reads only the tokens

    def kv_cache_allocated(self) -> None:
        return  # has no cache

    def propose_one(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """Drafts for one sequence, at most `min(k, max_drafts)` of them."""
        limit = min(self.k, max_drafts)
        length = len(token_ids)
        if limit <= 0 or length < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n :]
            # windows starting at 0 .. length-n-1: every occurrence before the suffix itself
            windows = sliding_window_view(tokens[: length - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[0]) + n
                return token_ids[start : start + limit]
        return []
