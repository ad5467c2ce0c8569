"""Drafting with a small model that shares the target's vocabulary (vLLM's `draft_model`).

The draft has its own KV cache layers but no blocks of its own: position p of a
request sits at the same slot of the draft's cache as of the target's, so the
target's block tables serve both (the scheduler reserves k lookahead slots past
each decode for the draft's proposals). After each step the draft catches up on
the tokens it has not seen (a whole prompt for a new request; the accepted
tokens after a verification), then drafts k tokens one at a time:

    tokens:  t0 ... t(N-2) t(N-1) | d1   d2  ... d(k-1)
    fed:     (cached, valid)  ^catch-up ^one step each   -> d1 .. dk
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from minivllm.config import EngineConfig, ModelConfig
from minivllm.distributed.parallel_state import tp_broadcast
from minivllm.kernels.registry import Kernels
from minivllm.layers.attention import Attention, KVCacheSpec
from minivllm.layers.attention.backend import AttentionBackend, build_common_metadata
from minivllm.layers.forward_context import ForwardContext, forward_context
from minivllm.layers.sampler import Sampler
from minivllm.loader.model_loader import load_model
from minivllm.spec_decode.config import SpeculativeConfig
from minivllm.spec_decode.proposer import Proposal
from minivllm.worker.request_state import CachedRequestState


@dataclass(slots=True)
class DraftState:
    """What the draft's cache holds for one request: real tokens at positions
    0..num_real-1, then the drafts it was fed (valid only as far as they were accepted)."""

    num_real: int
    fed_drafts: list[int]


class DraftModelProposer:
    def __init__(
        self,
        config: SpeculativeConfig,
        engine: EngineConfig,
        kernels: Kernels,
        backend: AttentionBackend,
        sampler: Sampler,
    ) -> None:
        from transformers import AutoConfig

        path = config.model
        hf_config = AutoConfig.from_pretrained(
            path, trust_remote_code=engine.model.trust_remote_code
        )
        model_config = ModelConfig(
            model=path,
            tokenizer=path,
            hf_config=hf_config,
            dtype=engine.model.dtype,
            max_model_len=engine.scheduler.max_model_len,
            seed=engine.model.seed,
        )
        self.device = engine.device
        self.block_size = engine.cache.block_size
        self.probabilistic = config.draft_sample_method == "probabilistic"
        self.model: nn.Module = load_model(model_config, self.device, kernels)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.kv_cache_specs: list[KVCacheSpec] = [
            layer.get_kv_cache_spec(self.block_size, engine.model.dtype)
            for layer in self.attention_layers
        ]
        self.backend = backend
        self.sampler = sampler
        self.states: dict[str, DraftState] = {}

    def remove(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self.states.pop(req_id, None)

    @torch.inference_mode()
    def propose(self, states: list[CachedRequestState], limits: list[int]) -> dict[str, Proposal]:
        """Up to `limits[i]` drafts after each state's tokens."""
        todo = [(s, n) for s, n in zip(states, limits) if n > 0]
        if not todo:
            return {}
        proposals = [Proposal([], [], []) for _ in todo]
        hidden = self._catch_up([s for s, _ in todo])
        active = list(range(len(todo)))
        while True:
            logits = self.model.compute_logits(hidden).float()
            tokens, probs = self._choose(logits, [todo[i][0] for i in active])
            top2 = logits.topk(2, dim=-1).values if logits.shape[-1] > 1 else logits.repeat(1, 2)
            margins = (top2[:, 0] - top2[:, 1]).clamp(max=40.0).tolist()
            for row, i in enumerate(active):
                proposals[i].drafts.append(tokens[row])
                proposals[i].margins.append(margins[row])
                if probs is not None:
                    proposals[i].prob_rows.append(probs[row])
            active = [i for i in active if len(proposals[i].drafts) < todo[i][1]]
            if not active:
                break
            hidden = self._step([(todo[i][0], proposals[i].drafts) for i in active])
        for (state, _), proposal in zip(todo, proposals):
            self.states[state.req_id] = DraftState(len(state.token_ids), proposal.drafts[:-1])
        return {state.req_id: p for (state, _), p in zip(todo, proposals)}

    def _valid_prefix(self, state: CachedRequestState) -> int:
        """How many leading positions of the draft's cache hold this request's tokens."""
        held = self.states.get(state.req_id)
        if held is None:
            return 0
        tokens = state.token_ids
        valid = held.num_real
        for draft in held.fed_drafts:
            if valid >= len(tokens) - 1 or tokens[valid] != draft:
                break
            valid += 1
        return min(valid, len(tokens) - 1)

    def _catch_up(self, states: list[CachedRequestState]) -> torch.Tensor:
        """Feed every token the draft has not seen, through the last one; returns the
        hidden rows of each request's last token."""
        ids, positions, slots, cu, seq_lens, tables, last_rows = [], [], [], [0], [], [], []
        for state in states:
            start, end = self._valid_prefix(state), len(state.token_ids)
            ids += state.token_ids[start:end]
            positions += range(start, end)
            slots += [self._slot(state, p) for p in range(start, end)]
            cu.append(cu[-1] + end - start)
            seq_lens.append(end)
            tables.append(state.block_ids)
            last_rows.append(cu[-1] - 1)
        hidden = self._forward(ids, positions, slots, cu, seq_lens, tables)
        return hidden[last_rows]

    def _step(self, feed: list[tuple[CachedRequestState, list[int]]]) -> torch.Tensor:
        """Each request's newest draft, at the position after its real tokens and earlier drafts."""
        ids, positions, slots, seq_lens, tables = [], [], [], [], []
        for state, drafts in feed:
            pos = len(state.token_ids) - 1 + len(drafts)
            ids.append(drafts[-1])
            positions.append(pos)
            slots.append(self._slot(state, pos))
            seq_lens.append(pos + 1)
            tables.append(state.block_ids)
        cu = list(range(len(feed) + 1))
        return self._forward(ids, positions, slots, cu, seq_lens, tables)

    def _slot(self, state: CachedRequestState, position: int) -> int:
        block = state.block_ids[position // self.block_size]
        return block * self.block_size + position % self.block_size

    def _forward(self, ids, positions, slots, cu, seq_lens, tables) -> torch.Tensor:
        common = build_common_metadata(slots, cu, seq_lens, tables, self.block_size, self.device)
        meta = self.backend.build_metadata(common)
        with forward_context(ForwardContext((self.backend, meta))):
            return self.model(
                torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device)
            )

    def _choose(
        self, logits: torch.Tensor, states: list[CachedRequestState]
    ) -> tuple[list[int], torch.Tensor | None]:
        """Each row's draft token (rank 0's on every TP rank) and, when drafting is
        probabilistic, the distribution q = softmax(logits / T) it was drawn from."""
        greedy = logits.argmax(dim=-1)
        if not self.probabilistic:
            return tp_broadcast(greedy).tolist(), None
        params = [s.sampling_params for s in states]
        temps = torch.tensor(
            [1.0 if p.is_greedy else p.temperature for p in params], device=logits.device
        )
        probs = (logits / temps.unsqueeze(1)).softmax(dim=-1)
        gens = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        is_greedy = torch.tensor([p.is_greedy for p in params], device=logits.device)
        tokens = torch.where(is_greedy, greedy, self.sampler.draw(probs, gens))
        return tp_broadcast(tokens).tolist(), probs
