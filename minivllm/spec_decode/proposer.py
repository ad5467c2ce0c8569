"""What every draft method gives the verifier: drafts, and what it knows about them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from minivllm.distributed.parallel_state import tp_broadcast
from minivllm.layers.sampler import Sampler
from minivllm.worker.request_state import CachedRequestState

MAX_MARGIN = 40.0  # top-2 logit margins are clamped here (and NaN becomes 0)


@dataclass(slots=True)
class Proposal:
    drafts: list[int]
    # the top-2 logit margin at each draft position, where the method has logits
    # (the acceptance estimator's feature); empty for n-gram drafts
    margins: list[float] = field(default_factory=list)
    # the draft distribution at each position (probabilistic drafting only)
    prob_rows: list[torch.Tensor] = field(default_factory=list)

    @property
    def probs(self) -> torch.Tensor | None:
        return torch.stack(self.prob_rows) if self.prob_rows else None


@dataclass(slots=True)
class TargetHiddenStates:
    """The seam that hands the target's final hidden states to a proposer that reads them
    (EAGLE): this step's hidden rows, and for each scheduled request where its rows are.

    `spans[i]` = (req_id, first position computed, first row in `hidden`, number of rows).
    Rows of drafts the verifier then rejects are included; the proposer drops them once
    it knows how many tokens each request kept.
    """

    hidden: torch.Tensor
    spans: list[tuple[str, int, int, int]]


class Proposer(Protocol):
    # whether the runner should call `observe_hidden_states` after each target forward
    uses_hidden_states: bool

    def observe_hidden_states(self, states: TargetHiddenStates) -> None:
        """This step's target hidden states (only called when `uses_hidden_states`)."""
        ...

    def propose(self, states: list[CachedRequestState], limits: list[int]) -> dict[str, Proposal]:
        """At most `limits[i]` drafts to follow each state's tokens (none: no entry)."""
        ...

    def remove(self, req_ids: set[str]) -> None:
        """Forget requests the runner dropped."""
        ...

    def kv_cache_allocated(self) -> None:
        """Called once the runner has allocated every layer's KV cache."""
        ...


def choose_drafts(
    logits: torch.Tensor,
    states: list[CachedRequestState],
    probabilistic: bool,
    sampler: Sampler,
    drafted: list[list[int]] | None = None,
    watermarker=None,
) -> tuple[list[int], torch.Tensor | None, list[float]]:
    """Each row's draft token (rank 0's on every TP rank), the distribution
    q = softmax(logits / T) it was drawn from when drafting is probabilistic, and the
    top-2 logit margin of each row (the acceptance estimator's feature). With a
    dual-key `watermarker`, probabilistic drafts are drawn by Gumbel-max with key A
    (each row's context includes its earlier `drafted` tokens)."""
    logits = logits.float()
    top2 = logits.topk(2, dim=-1).values if logits.shape[-1] > 1 else logits.repeat(1, 2)
    margins = (top2[:, 0] - top2[:, 1]).nan_to_num(0.0).clamp(0.0, MAX_MARGIN).tolist()
    greedy = logits.argmax(dim=-1)
    if not probabilistic:
        return tp_broadcast(greedy).tolist(), None, margins
    params = [s.sampling_params for s in states]
    temps = torch.tensor(
        [1.0 if p.is_greedy else p.temperature for p in params], device=logits.device
    )
    probs = (logits / temps.unsqueeze(1)).softmax(dim=-1)
    gens = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
    is_greedy = torch.tensor([p.is_greedy for p in params], device=logits.device)
    sampled = sampler.draw(probs, gens)
    if watermarker is not None and watermarker.draft_key is not None:
        pending = drafted if drafted is not None else [[] for _ in states]
        sampled = watermarker.mark(probs, states, pending, sampled, watermarker.draft_key)
    tokens = torch.where(is_greedy, greedy, sampled)
    return tp_broadcast(tokens).tolist(), probs, margins
