"""Verify drafted tokens against the target model so the output keeps the target's distribution.

Speculative sampling (Leviathan et al. 2023, arXiv:2211.17192; Chen et al. 2023,
arXiv:2302.01318). For a request with drafts x_1..x_k, the target gives p_0..p_k
(p_j: the distribution after the tokens so far and x_1..x_j); q_j is the draft's.

    greedy request:  accept x_{j+1} iff x_{j+1} == argmax p_j; at the first mismatch
                     emit argmax p_j and stop.
    random request:  accept x_{j+1} iff u < p_j(x_{j+1}) / q_j(x_{j+1}), u ~ U(0, 1)
                     (greedy drafts are one-hot: q_j(x_{j+1}) = 1); at the first
                     rejection emit a draw from max(p_j - q_j, 0) (one-hot: p_j without
                     x_{j+1}), renormalised, and stop.
    all accepted:    emit a bonus token from p_k (argmax for greedy requests).

Each emitted token is then distributed exactly as the target would have sampled it.
`synthetic` mode (benchmarking only) accepts position j with a fixed probability instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from minivllm.layers.sampler import Sampler, SamplingMetadata


@dataclass(slots=True)
class VerifyRequest:
    """One request's part of the verification rows: rows `first_row .. first_row + len(drafts)`."""

    first_row: int
    drafts: list[int]
    is_greedy: bool
    generator: torch.Generator | None  # the request's seeded stream, if it has a seed
    draft_probs: torch.Tensor | None = None  # [len(drafts), V] for probabilistic drafts


@dataclass(slots=True)
class VerifyResult:
    emitted: list[list[int]]  # per request: accepted drafts, then one recovery or bonus token
    num_accepted: list[int]  # per request: drafts accepted


class RejectionSampler:
    def __init__(self, sampler: Sampler, synthetic_rates: tuple[float, ...] | None = None) -> None:
        self.sampler = sampler
        self.synthetic_rates = synthetic_rates

    def __call__(
        self,
        logits: torch.Tensor,
        meta: SamplingMetadata,
        requests: list[VerifyRequest],
        mark_final: Callable | None = None,
    ) -> VerifyResult:
        """`logits`: [sum(len(drafts) + 1), V], one row per verified position; `meta` per row.
        `mark_final(probs, request_indices, accepted_drafts, draws)` may replace the
        random requests' final draws (the watermark's keyed choice)."""
        self.device = logits.device
        greedy, probs = self.sampler.target_distribution(logits, meta)
        greedy_list = greedy.tolist()
        emitted, accepted, final_rows, final_gens = [], [], [], {}
        for req in requests:
            first = req.first_row
            num = self._num_accepted(req, greedy_list, probs)
            accepted.append(num)
            tokens = list(req.drafts[:num])
            if req.is_greedy:
                tokens.append(greedy_list[first + num])
            else:
                final_rows.append(self._final_distribution(req, num, probs))
                if req.generator is not None:
                    final_gens[len(final_rows) - 1] = req.generator
            emitted.append(tokens)
        if final_rows:
            final = torch.stack(final_rows)
            draws = self.sampler.draw(final, final_gens)
            if mark_final is not None:
                which = [i for i, req in enumerate(requests) if not req.is_greedy]
                draws = mark_final(final, which, [emitted[i] for i in which], draws)
            draws = draws.tolist()
            it = iter(draws)
            for req, tokens in zip(requests, emitted):
                if not req.is_greedy:
                    tokens.append(next(it))
        return VerifyResult(emitted, accepted)

    def _num_accepted(
        self, req: VerifyRequest, greedy: list[int], probs: torch.Tensor | None
    ) -> int:
        k, first = len(req.drafts), req.first_row
        if k == 0:
            return 0
        if self.synthetic_rates is not None:
            coins = self._uniforms(k, req.generator)
            rates = torch.tensor(self.synthetic_rates[:k], device=self.device)
            passed = (coins < rates).tolist()
        elif req.is_greedy:
            passed = [req.drafts[j] == greedy[first + j] for j in range(k)]
        else:
            rows = torch.arange(first, first + k, device=self.device)
            drafts = torch.tensor(req.drafts, device=self.device)
            p = probs[rows, drafts]
            q = (
                torch.ones(k, device=self.device)
                if req.draft_probs is None
                else req.draft_probs[rows - first, drafts]
            )
            # u < p / q, written without the division (q may be 0 for a draft off q's support)
            passed = (self._uniforms(k, req.generator) * q < p).tolist()
        num = 0
        while num < k and passed[num]:
            num += 1
        return num

    def _final_distribution(
        self, req: VerifyRequest, num: int, probs: torch.Tensor
    ) -> torch.Tensor:
        """p_k after all drafts passed; else the recovery distribution at the rejection."""
        row = probs[req.first_row + num]
        if num == len(req.drafts):
            return row
        if req.draft_probs is None:  # one-hot draft: p without the rejected token
            recovery = row.clone()
            recovery[req.drafts[num]] = 0.0
        else:
            recovery = (row - req.draft_probs[num]).clamp_(min=0.0)
        # a rejection means p(x) < q(x) somewhere, so p - q has mass left; guard rounding
        return recovery if recovery.sum() > 0 else row

    def _uniforms(self, n: int, generator: torch.Generator | None) -> torch.Tensor:
        generator = generator or self.sampler.generator
        return torch.rand(n, generator=generator, device=generator.device)
