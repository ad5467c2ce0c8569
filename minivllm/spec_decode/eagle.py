"""EAGLE drafting (vLLM's `eagle` method): a one-layer head reads the target's hidden states.

The runner hands this proposer every target forward's final hidden states through
`TargetHiddenStates` (the seam in `proposer.py`); the proposer keeps, per request,
the features the head has not consumed yet. The head's cache entry at position p
holds (x_{p+1}, f_p), so it can only be written once the token after p is known.
After each step the head catches up on every position whose feature and next token
are both real (a whole prompt after a prefill; the accepted run after a
verification), then drafts k tokens, feeding each draft with its own predicted
feature:

    target:  f_0 ... f_(N-2)         (features of accepted tokens; x_(N-1) just sampled)
    head:    (x_1,f_0) ... (x_(N-1),f_(N-2)) -> g -> d1 | (d1,g) -> g' -> d2 | ...

Rows of rejected drafts are dropped: the next step recomputes from the first
rejected position, and only features of positions <= N-2 are ever fed.

A request whose prefix came from the prefix cache starts its head at the first
position the target computes: the head's entries for the cached positions are the
ones the request that computed those blocks wrote (the last entry of such a block
was written with that request's next token), or zeros where that request stopped
before its head caught up (a request that is not drafting catches up only once
CATCH_UP_ROWS features wait, and one that finishes first leaves its entries
unwritten; the head's cache is zeroed at start-up). Only draft quality can suffer
from that; verification keeps the output exact.

Memory: a request's features wait in `pending` until its prefill ends (prompt
length x hidden size x dtype size, e.g. 256 MiB for 32k tokens at 4096 x bf16),
outside the KV budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minivllm.layers.forward_context import forward_context
from minivllm.models.eagle import EagleForCausalLM
from minivllm.spec_decode.draft_model import SharedCacheDrafter
from minivllm.spec_decode.proposer import Proposal, TargetHiddenStates
from minivllm.worker.request_state import CachedRequestState

# a request not drafting (adaptive verification said no) still feeds its head once
# this many features wait, so memory per request stays bounded and catching up is batched
CATCH_UP_ROWS = 256


@dataclass(slots=True)
class HeadState:
    fed: int  # head positions 0..fed-1 hold entries written from real target features
    pending: list[torch.Tensor] = field(default_factory=list)  # features of fed, fed+1, ...
    num_pending: int = 0

    def truncate(self, num: int) -> None:
        """Keep the features of the first `num` pending positions."""
        if num >= self.num_pending:
            return
        rows = torch.cat(self.pending)[:num] if num > 0 else None
        self.pending = [rows] if rows is not None else []
        self.num_pending = num


class EagleProposer(SharedCacheDrafter):
    uses_hidden_states = True

    def __init__(self, *args, target, **kwargs) -> None:
        """`target`: the target model, whose `embed_input_ids` and `compute_logits` the
        head shares."""
        super().__init__(*args, model_cls=EagleForCausalLM, mapped_target=target, **kwargs)
        hidden = self.model.config.hidden_size
        if hidden != target.config.hidden_size:
            raise ValueError(
                f"the EAGLE head's hidden size is {hidden}, the target's "
                f"{target.config.hidden_size}: the head was trained for another model"
            )
        self.target = target
        self.heads: dict[str, HeadState] = {}

    def remove(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self.heads.pop(req_id, None)

    def kv_cache_allocated(self) -> None:
        """The head may read entries no request wrote (a prefix-cache hit on blocks whose
        owner stopped before its head caught up): zeros, never garbage or NaN. Its one
        layer is a small share of the pool."""
        for layer in self.attention_layers:
            layer.kv_cache.zero_()

    def observe_hidden_states(self, states: TargetHiddenStates) -> None:
        for req_id, start, first_row, num in states.spans:
            head = self.heads.get(req_id)
            if head is None or not head.fed <= start <= head.fed + head.num_pending:
                # first sight (after any prefix-cache hit), or a gap: restart the head here
                head = self.heads[req_id] = HeadState(start)
            head.truncate(start - head.fed)  # rows of rejected drafts are recomputed
            head.pending.append(states.hidden[first_row : first_row + num].clone())
            head.num_pending += num

    @torch.inference_mode()
    def propose(self, states: list[CachedRequestState], limits: list[int]) -> dict[str, Proposal]:
        feed, drafting = [], []
        for state, limit in zip(states, limits):
            head = self.heads.get(state.req_id)
            if head is None:
                continue
            usable = min(len(state.token_ids) - 1 - head.fed, head.num_pending)
            if usable <= 0 or (limit <= 0 and usable < CATCH_UP_ROWS):
                continue
            feed.append((state, head, usable))
            drafting.append(limit if len(state.token_ids) - 1 == head.fed + usable else 0)
        if not feed:
            return {}
        predicted = self._catch_up(feed)
        todo = [(f[0], n, row) for f, n, row in zip(feed, drafting, predicted) if n > 0]
        return self._draft(todo)

    def _catch_up(self, feed: list[tuple[CachedRequestState, HeadState, int]]) -> torch.Tensor:
        """Feed each head its pending (x_{p+1}, f_p) rows; returns each request's last
        predicted feature (the one after its newest real token)."""
        ids, positions, slots, cu, seq_lens, tables, features = [], [], [], [0], [], [], []
        for state, head, usable in feed:
            start, end = head.fed, head.fed + usable
            ids += state.token_ids[start + 1 : end + 1]
            positions += range(start, end)
            slots += [self._slot(state, p) for p in range(start, end)]
            cu.append(cu[-1] + usable)
            seq_lens.append(end)
            tables.append(state.block_ids)
            features.append(torch.cat(head.pending)[:usable])
            head.fed, head.pending, head.num_pending = end, [], 0
        predicted = self._forward(ids, positions, slots, cu, seq_lens, tables, torch.cat(features))
        return predicted[[c - 1 for c in cu[1:]]]

    def _draft(self, todo: list[tuple[CachedRequestState, int, torch.Tensor]]) -> dict:
        if not todo:
            return {}
        predicted = torch.stack([row for _, _, row in todo])
        proposals = self._draft_loop(
            [(state, n) for state, n, _ in todo], predicted, self.target.compute_logits, self._step
        )
        return {state.req_id: p for (state, _, _), p in zip(todo, proposals)}

    def _step(
        self, feed: list[tuple[CachedRequestState, list[int]]], features: torch.Tensor
    ) -> torch.Tensor:
        """Each request's newest draft with the feature predicted for its position."""
        return self._forward(*self._newest_draft_inputs(feed, lag=1), features)

    def _forward(self, ids, positions, slots, cu, seq_lens, tables, features) -> torch.Tensor:
        ids_t = torch.tensor(ids, device=self.device)
        with forward_context(self._context(slots, cu, seq_lens, tables)):
            return self.model(
                self.target.embed_input_ids(ids_t),
                features,
                torch.tensor(positions, device=self.device),
            )
