"""The model runner's speculative-decoding part: verify this step's drafts, propose the next.

The runner stays a plain loop: when a step carries drafts it hands the sampling
rows to `verify` instead of the sampler, and after every step it asks `propose`
for the drafts the scheduler will schedule next (the scheduler only sees more
tokens per request).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from minivllm.distributed.parallel_state import tp_broadcast
from minivllm.layers.sampler import Sampler
from minivllm.spec_decode.adaptive import AdaptiveVerifier, CostCurve
from minivllm.spec_decode.config import SpeculativeConfig
from minivllm.spec_decode.proposer import Proposal, Proposer
from minivllm.spec_decode.rejection_sampler import RejectionSampler, VerifyRequest
from minivllm.worker.input_batch import InputBatch
from minivllm.worker.request_state import CachedRequestState


@dataclass(slots=True)
class Verified:
    emitted: list[list[int]]  # per sampling request: the tokens it gains this step
    rows: list[list[int]]  # per sampling request: the logits row of each emitted token


class SpecDecoder:
    def __init__(
        self, config: SpeculativeConfig, proposer: Proposer, sampler: Sampler, max_model_len: int
    ) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.proposer = proposer
        self.rejection_sampler = RejectionSampler(sampler, config.synthetic_acceptance_rates)
        # the proposals the scheduler was given, for their draft distributions at verification
        self.proposals: dict[str, Proposal] = {}
        # set by the runner once it has profiled its step cost (enable_adaptive_verification)
        self.adaptive: AdaptiveVerifier | None = None
        # set by the runner when the engine watermarks (`watermark/generation.py`)
        self.watermarker = None

    def enable_adaptive(self, verify_cost: CostCurve) -> None:
        self.adaptive = AdaptiveVerifier(self.k, verify_cost)

    def remove(self, req_ids: set[str]) -> None:
        self.proposer.remove(req_ids)
        for req_id in req_ids:
            self.proposals.pop(req_id, None)

    def verify(
        self,
        logits: torch.Tensor,
        states: list[CachedRequestState],
        drafts: list[list[int]],
        input_batch: InputBatch,
    ) -> Verified:
        """`logits`: for each state in order, one row per draft plus one (the bonus row)."""
        meta = input_batch.metadata_for_verification([s.req_id for s in states], drafts)
        requests, rows, first = [], [], 0
        for state, req_drafts in zip(states, drafts):
            probs = None
            proposal = self.proposals.get(state.req_id)
            if req_drafts and proposal is not None and proposal.prob_rows:
                probs = proposal.probs[: len(req_drafts)]  # the scheduler may have cut some
            params = state.sampling_params
            requests.append(
                VerifyRequest(first, req_drafts, params.is_greedy, state.generator, probs)
            )
            rows.append(list(range(first, first + len(req_drafts) + 1)))
            first += len(req_drafts) + 1
        mark_final = None
        if self.watermarker is not None:
            key = self.watermarker.key_b

            def mark_final(probs, which, accepted, draws):
                chosen = [states[i] for i in which]
                return self.watermarker.mark(probs, chosen, accepted, draws, key)

        result = self.rejection_sampler(logits, meta, requests, mark_final)
        emitted = _broadcast(result.emitted, self.k + 1, logits.device)
        if self.adaptive is not None:
            self._learn(states, drafts, emitted)
        return Verified(emitted, [r[: len(e)] for r, e in zip(rows, emitted)])

    def propose(self, states: list[CachedRequestState]) -> dict[str, list[int]]:
        """Drafts to follow each state's tokens, never past max_model_len or max_tokens."""
        limits = [self._max_drafts(state) for state in states]
        adaptive = self.adaptive
        only_explorers = adaptive is not None and not adaptive.should_draft()
        if only_explorers:
            if not adaptive.exploring:
                adaptive.skip()
                # no drafts, but a proposer that tracks the target (EAGLE) may catch up
                self.proposer.propose(states, [0] * len(states))
                self.proposals = {}
                return {}
            explorers = set(adaptive.explorers(len(states)))
            limits = [n if i in explorers else 0 for i, n in enumerate(limits)]
        start = time.perf_counter()
        self.proposals = self.proposer.propose(states, limits)
        if self.config.rejection_sample_method == "synthetic":
            self._pad_synthetic(states, limits)
        if self.adaptive is not None:
            num_drafting = sum(1 for n in limits if n > 0)
            self.adaptive.draft_cost.observe(num_drafting, time.perf_counter() - start)
            self._trim(states, only_explorers)
        return {req_id: p.drafts for req_id, p in self.proposals.items()}

    def _trim(self, states: list[CachedRequestState], only_explorers: bool = False) -> None:
        """Keep only the drafts the adaptive planner admits."""
        ids = [s.req_id for s in states if s.req_id in self.proposals]
        if not ids:  # nothing drafted (every request at its limit): no plan to make
            self.adaptive.skip()
            return
        proposals = [self.proposals[r] for r in ids]
        context = sum(len(s.token_ids) for s in states) / len(states)
        plan = self.adaptive.plan(
            [p.drafts for p in proposals],
            [p.margins for p in proposals],
            len(states),
            len(states),
            context,
            only_explorers,
        )
        for req_id, proposal, keep in zip(ids, proposals, plan.admitted):
            proposal.drafts = proposal.drafts[:keep]
            proposal.prob_rows = proposal.prob_rows[:keep]
            if not keep:
                del self.proposals[req_id]

    def _learn(
        self,
        states: list[CachedRequestState],
        drafts: list[list[int]],
        emitted: list[list[int]],
    ) -> None:
        """Feed the estimator this step's outcomes, except from requests whose target
        distribution the draft cannot see (penalties, logit bias, min_tokens bans: vLLM #57533)."""
        for state, req_drafts, tokens in zip(states, drafts, emitted):
            proposal = self.proposals.get(state.req_id)
            if not req_drafts or has_target_only_transforms(state):
                continue
            features = proposal.margins if proposal is not None else []
            self.adaptive.estimator.observe(features, len(req_drafts), len(tokens) - 1)
        self.adaptive.estimator.step()

    def _pad_synthetic(self, states: list[CachedRequestState], limits: list[int]) -> None:
        """Benchmarking: the configured rates decide acceptance, so drafts only need to
        exist; pad to the limit with the last token, at n-gram cost."""
        for state, limit in zip(states, limits):
            proposal = self.proposals.setdefault(state.req_id, Proposal([]))
            proposal.drafts += [state.token_ids[-1]] * (limit - len(proposal.drafts))
            proposal.prob_rows = []
            if not proposal.drafts:
                del self.proposals[state.req_id]

    def _max_drafts(self, state: CachedRequestState) -> int:
        # the next step computes positions num_tokens - 1 .. num_tokens - 1 + drafts
        limit = min(self.k, self.max_model_len - len(state.token_ids))
        max_tokens = state.sampling_params.max_tokens
        if max_tokens is not None:  # the target adds one token after the accepted drafts
            limit = min(limit, max_tokens - len(state.output_token_ids) - 1)
        return max(limit, 0)


def has_target_only_transforms(state: CachedRequestState) -> bool:
    p = state.sampling_params
    return p.uses_penalties or bool(p.logit_bias) or len(state.output_token_ids) < p.min_tokens


def _broadcast(emitted: list[list[int]], width: int, device: torch.device) -> list[list[int]]:
    """Rank 0's verification result on every tensor-parallel rank (identity with one rank)."""
    lengths = torch.tensor([len(e) for e in emitted], device=device)
    tokens = torch.zeros(len(emitted), width, dtype=torch.long, device=device)
    for i, e in enumerate(emitted):
        tokens[i, : len(e)] = torch.tensor(e, dtype=torch.long)
    lengths, tokens = tp_broadcast(lengths), tp_broadcast(tokens)
    return [row[:n] for row, n in zip(tokens.tolist(), lengths.tolist())]
