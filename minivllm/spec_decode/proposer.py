"""What every draft method gives the verifier: drafts, and what it knows about them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from minivllm.worker.request_state import CachedRequestState


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


class Proposer(Protocol):
    def propose(self, states: list[CachedRequestState], limits: list[int]) -> dict[str, Proposal]:
        """At most `limits[i]` drafts to follow each state's tokens (none: no entry)."""
        ...

    def remove(self, req_ids: set[str]) -> None:
        """Forget requests the runner dropped."""
        ...
