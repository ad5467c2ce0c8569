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

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from minivllm.config import EngineConfig, ModelConfig
from minivllm.kernels.registry import Kernels
from minivllm.layers.attention import Attention, KVCacheSpec
from minivllm.layers.attention.backend import AttentionBackend, build_common_metadata
from minivllm.layers.forward_context import ForwardContext, forward_context
from minivllm.layers.sampler import Sampler
from minivllm.loader.model_loader import load_model
from minivllm.quantization.compressed_tensors import read_checkpoint_quantization
from minivllm.quantization.kv_cache import use_kv_scales
from minivllm.spec_decode.config import SpeculativeConfig
from minivllm.spec_decode.proposer import Proposal, TargetHiddenStates, choose_drafts
from minivllm.worker.request_state import CachedRequestState


@dataclass(slots=True)
class DraftState:
    """What the draft's cache holds for one request: real tokens at positions
    0..num_real-1, then the drafts it was fed (valid only as far as they were accepted)."""

    num_real: int
    fed_drafts: list[int]


def draft_model_config(config: SpeculativeConfig, engine: EngineConfig) -> ModelConfig:
    """The draft's model config: its checkpoint, in the target's dtype and context length."""
    from transformers import AutoConfig

    path = config.model
    hf_config = AutoConfig.from_pretrained(path, trust_remote_code=engine.model.trust_remote_code)
    return ModelConfig(
        model=path,
        tokenizer=path,
        hf_config=hf_config,
        dtype=engine.model.dtype,
        max_model_len=engine.scheduler.max_model_len,
        seed=engine.model.seed,
        # a compressed-tensors draft loads its quantized layers and fp8 KV-cache scales
        checkpoint_quantization=read_checkpoint_quantization(hf_config),
    )


def draft_model_class(config: SpeculativeConfig) -> type[nn.Module] | None:
    """The class a method builds its draft as (None: the checkpoint's architecture)."""
    if config.method == "eagle":
        from minivllm.models.eagle import EagleForCausalLM

        return EagleForCausalLM
    return None


class SharedCacheDrafter:
    """A drafting network with KV cache layers of its own that sit in the target's blocks:
    position p of a request uses the same slot in both caches (draft_model and eagle)."""

    uses_hidden_states = False

    def __init__(
        self,
        config: SpeculativeConfig,
        engine: EngineConfig,
        kernels: Kernels,
        backend: AttentionBackend,
        sampler: Sampler,
        model_cls: type[nn.Module] | None = None,
        mapped_target: nn.Module | None = None,
    ) -> None:
        """`mapped_target`: the target model; where its weights came from a weight-cache
        daemon that holds this draft too (`load_format="ipc_cache"`), the draft maps them
        as well instead of loading its checkpoint."""
        model_config = draft_model_config(config, engine)
        self.device = engine.device
        self.block_size = engine.cache.block_size
        self.probabilistic = config.draft_sample_method == "probabilistic"
        model = None
        if mapped_target is not None and engine.load_format == "ipc_cache":
            from minivllm.weight_cache.loader import map_draft_model

            model = map_draft_model(mapped_target, engine, model_config, kernels, model_cls)
        if model is None:
            model = load_model(model_config, self.device, kernels, model_cls=model_cls)
        self.model: nn.Module = model
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        kv_dtype = engine.cache.kv_dtype(engine.model.dtype)
        self.kv_cache_specs: list[KVCacheSpec] = [
            layer.get_kv_cache_spec(self.block_size, kv_dtype) for layer in self.attention_layers
        ]
        use_kv_scales(self.attention_layers, kv_dtype, engine.cache.calculate_kv_scales)
        self.backend = backend
        self.sampler = sampler
        self.watermarker = None  # set by the runner when the engine watermarks

    def observe_hidden_states(self, states: TargetHiddenStates) -> None:
        return  # only EAGLE reads them

    def kv_cache_allocated(self) -> None:
        return  # a draft model's entries are written before they are read

    def _slot(self, state: CachedRequestState, position: int) -> int:
        block = state.block_ids[position // self.block_size]
        return block * self.block_size + position % self.block_size

    def _draft_loop(
        self,
        todo: list[tuple[CachedRequestState, int]],
        hidden: torch.Tensor,
        logits_of: Callable[[torch.Tensor], torch.Tensor],
        step: Callable[[list[tuple[CachedRequestState, list[int]]], torch.Tensor], torch.Tensor],
    ) -> list[Proposal]:
        """Draft one token per active request at a time until each has its limit:
        `hidden` holds one row per request of `todo`, `logits_of` turns rows into draft
        logits, `step(feed, rows)` feeds each still-active request's newest draft (with its
        previous row) and returns the next rows."""
        proposals = [Proposal([], [], []) for _ in todo]
        active = list(range(len(todo)))
        while True:
            tokens, probs, margins = choose_drafts(
                logits_of(hidden),
                [todo[i][0] for i in active],
                self.probabilistic,
                self.sampler,
                [proposals[i].drafts for i in active],
                self.watermarker,
            )
            for row, i in enumerate(active):
                proposals[i].drafts.append(tokens[row])
                proposals[i].margins.append(margins[row])
                if probs is not None:
                    proposals[i].prob_rows.append(probs[row])
            keep = [row for row, i in enumerate(active) if len(proposals[i].drafts) < todo[i][1]]
            if not keep:
                return proposals
            active = [active[row] for row in keep]
            hidden = step([(todo[i][0], proposals[i].drafts) for i in active], hidden[keep])

    def _newest_draft_inputs(
        self, feed: list[tuple[CachedRequestState, list[int]]], lag: int
    ) -> tuple[list[int], list[int], list[int], list[int], list[int], list[list[int]]]:
        """(ids, positions, slots, cu, seq_lens, tables) feeding each request's newest
        draft d_j (of N tokens) at position N - 1 + j - lag: a draft model's at N - 1 + j,
        an EAGLE head's, whose entry p holds token p + 1, at N - 2 + j (lag 1)."""
        ids, positions, slots, seq_lens, tables = [], [], [], [], []
        for state, drafts in feed:
            pos = len(state.token_ids) - 1 + len(drafts) - lag
            ids.append(drafts[-1])
            positions.append(pos)
            slots.append(self._slot(state, pos))
            seq_lens.append(pos + 1)
            tables.append(state.block_ids)
        return ids, positions, slots, list(range(len(feed) + 1)), seq_lens, tables

    def _context(self, slots, cu, seq_lens, tables) -> ForwardContext:
        common = build_common_metadata(slots, cu, seq_lens, tables, self.block_size, self.device)
        return ForwardContext((self.backend, self.backend.build_metadata(common)))


class DraftModelProposer(SharedCacheDrafter):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
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
        hidden = self._catch_up([s for s, _ in todo])
        proposals = self._draft_loop(
            todo, hidden, self.model.compute_logits, lambda feed, _rows: self._step(feed)
        )
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
        return self._forward(*self._newest_draft_inputs(feed, lag=0))

    def _forward(self, ids, positions, slots, cu, seq_lens, tables) -> torch.Tensor:
        with forward_context(self._context(slots, cu, seq_lens, tables)):
            return self.model(
                torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device)
            )
