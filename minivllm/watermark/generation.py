"""Watermarked sampling: the final random choice made by keyed uniforms (Gumbel-max).

For a row with processed distribution p (after biases, penalties, temperature, min-p,
top-k and top-p) and context c (the h previous generated tokens, -1 before the first),
the token is argmax_v p_v / -ln(u_v) with u_v = PRF(key, c, v): the exponential race
of the ordinary sampler with keyed instead of fresh noise, i.e. argmax(ln p + Gumbel)
(Aaronson 2022; vLLM v0.30's `gumbel`). Over random keys each position's marginal is p;
for one key the choice is deterministic given p and c, which is what the detector
recognises. Logits are untouched, so returned logprobs are the pre-watermark ones.

Rows that are greedy, opted out (`SamplingParams(watermarking=False)`), or whose context
was already seen (deduplication) keep the ordinary draw made in the same step.
`dual_key_gumbel` routes each token to sub-key B with probability alpha by an unkeyed
coin from the request's own generator (so `seed` makes it reproducible).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from minivllm.kernels.registry import TORCH, Kernels
from minivllm.watermark.config import WatermarkConfig
from minivllm.watermark.prf import (
    SENTINEL,
    reference_context_state,
    split_key,
    vocab_uniforms,
)

logger = logging.getLogger("minivllm")


@dataclass(slots=True)
class ContextHistory:
    """Where each context of one request last occurred, for deduplication. Positions index
    the searched sequence: h sentinels (or, in mode `all`, the prompt) then the outputs."""

    prefix_len: int
    last_seen: dict[tuple[int, ...], int] = field(default_factory=dict)
    scanned: int = 0  # positions whose contexts are recorded (from h on)


class Watermarker:
    def __init__(
        self, config: WatermarkConfig, vocab_size: int, device: str, kernels: Kernels = TORCH
    ) -> None:
        self.config = config
        self.h = config.context_width
        dual = config.algorithm == "dual_key_gumbel"
        self.key_a, self.key_b = config.sub_keys if dual else (config.key, config.key)
        self.alpha = config.alpha if dual else 0.0
        # with speculative decoding, target draws (recovery, bonus, and steps without
        # drafts) use key B and drafts key A (dual key), or the one key target-only
        self.speculative = False
        self.vocab_size = vocab_size
        self.device = device
        self.histories: dict[str, ContextHistory] = {}
        # the compiled keyed argmax (kernels/watermark.cpp) where the engine has the kernels
        self.argmax_op = kernels.op("watermark_argmax")
        self._warned_greedy = False
        config.warn_about_weak_settings()

    def remove(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self.histories.pop(req_id, None)

    # --- which rows, with which key and context ---

    def context(self, outputs: list[int]) -> tuple[int, ...]:
        """The h tokens before the next output position, sentinel-padded."""
        tail = outputs[-self.h :]
        return tuple([SENTINEL] * (self.h - len(tail)) + tail)

    def is_fresh(
        self, req_id: str, prompt: list[int], outputs: list[int], pending: list[int] = ()
    ) -> bool:
        """Whether the context of the position after `outputs + pending` has not occurred
        earlier in the searched history (always true with deduplication off). `outputs`
        are committed and get recorded; `pending` tokens (earlier drafts of this step, or
        drafts accepted in this verification) only count for this check."""
        mode = self.config.deduplicate_contexts
        if mode == "none":
            return True
        if mode == "all" and len(outputs) + len(pending) < self.h:
            return False  # its context holds sentinels; mode `all` leaves those unmarked
        prefix = prompt if mode == "all" else [SENTINEL] * self.h
        history = self.histories.get(req_id)
        if history is None or history.prefix_len != len(prefix):
            history = self.histories[req_id] = ContextHistory(len(prefix), scanned=self.h)
        committed = prefix + outputs
        for end in range(max(history.scanned, self.h), len(committed)):
            history.last_seen[tuple(committed[end - self.h : end])] = end
        history.scanned = max(history.scanned, len(committed))
        seq = committed + list(pending)
        current = tuple(seq[len(seq) - self.h :])
        last = history.last_seen.get(current)
        for end in range(max(len(committed), self.h), len(seq)):
            if tuple(seq[end - self.h : end]) == current:
                last = end
        limit = self.config.deduplicate_contexts_max_history
        return last is None or (limit is not None and len(seq) - last > limit)

    def rows_to_mark(
        self, states: list, is_greedy: list[bool], pending: list[list[int]] | None = None
    ) -> list[int]:
        """The rows whose next token is watermarked: not opted out, not greedy, and with a
        fresh context (after each row's `pending` tokens, if given)."""
        rows = []
        for i, state in enumerate(states):
            if state.sampling_params.watermarking is False:
                continue
            if is_greedy[i]:
                if not self._warned_greedy:
                    self._warned_greedy = True
                    logger.warning(
                        "greedy requests (temperature 0) cannot be watermarked; they run "
                        "unwatermarked"
                    )
                continue
            prompt = state.token_ids[: state.num_prompt_tokens]
            extra = pending[i] if pending is not None else ()
            if self.is_fresh(state.req_id, prompt, state.output_token_ids, extra):
                rows.append(i)
        return rows

    def choose_keys(self, states: list, rows: list[int], fallback: torch.Generator) -> list[int]:
        """Key A or B per row: B with probability alpha, by the request's own generator
        (always B, the target's key, under speculative decoding)."""
        if self.speculative or self.alpha >= 1.0:
            return [self.key_b] * len(rows)
        if self.alpha <= 0.0:
            return [self.key_a] * len(rows)
        keys = []
        for i in rows:
            gen = states[i].generator or fallback
            coin = torch.rand((), generator=gen, device=gen.device).item()
            keys.append(self.key_b if coin < self.alpha else self.key_a)
        return keys

    # --- the draw ---

    def sample(self, sampler, logits: torch.Tensor, meta, states: list) -> torch.Tensor:
        """The sampler's step with the watermark on the final random choice."""
        greedy, probs = sampler.target_distribution(logits, meta)
        is_greedy = meta.is_greedy.tolist()
        if probs is None:
            self.rows_to_mark(states, is_greedy)  # warns once about greedy requests
            return greedy
        sampled = sampler.draw(probs, meta.generators)
        sampled = self.select(probs, states, is_greedy, sampled, sampler.generator)
        return torch.where(meta.is_greedy, greedy, sampled)

    def select(
        self,
        probs: torch.Tensor,
        states: list,
        is_greedy: list[bool],
        sampled: torch.Tensor,
        fallback: torch.Generator,
    ) -> torch.Tensor:
        """`sampled` with the watermarked rows' tokens replaced by their keyed choice."""
        rows = self.rows_to_mark(states, is_greedy)
        if not rows:
            return sampled
        keys = self.choose_keys(states, rows, fallback)
        contexts = [self.context(states[i].output_token_ids) for i in rows]
        chosen = keyed_choice(probs[rows], keys, contexts, self.device, self.argmax_op)
        sampled = sampled.clone()
        sampled[rows] = chosen
        return sampled

    def mark(
        self,
        probs: torch.Tensor,
        states: list,
        pending: list[list[int]],
        sampled: torch.Tensor,
        key: int,
    ) -> torch.Tensor:
        """Speculative decoding: row i (probabilities `probs[i]`, request `states[i]`, whose
        next position follows its outputs and `pending[i]`) drawn with `key` where it is
        watermarked, else `sampled[i]`. Drafts use key A (dual key); recovery and bonus
        tokens the target's key."""
        greedy = [s.sampling_params.is_greedy for s in states]
        rows = self.rows_to_mark(states, greedy, pending)
        if not rows:
            return sampled
        contexts = [self.context(states[i].output_token_ids + list(pending[i])) for i in rows]
        sampled = sampled.clone()
        sampled[rows] = keyed_choice(
            probs[rows], [key] * len(rows), contexts, self.device, self.argmax_op
        )
        return sampled

    @property
    def draft_key(self) -> int | None:
        """Key A for drafts (dual key); None: drafts are not watermarked (target-only)."""
        return self.key_a if self.config.algorithm == "dual_key_gumbel" else None


def keyed_uniforms(
    key: int, contexts: list[tuple[int, ...]], vocab_size: int, device
) -> torch.Tensor:
    """u [rows, vocab] for one key."""
    ctx = torch.tensor(contexts, dtype=torch.int64, device=device)
    return vocab_uniforms(key, ctx, vocab_size)


def keyed_choice(
    probs: torch.Tensor,
    keys: list[int],
    contexts: list[tuple[int, ...]],
    device,
    argmax_op: Callable | None = None,
) -> torch.Tensor:
    """argmax_v p_v / -ln u_v per row, u from that row's key and context; `argmax_op`
    (the compiled kernel) computes the same without materialising u."""
    if argmax_op is not None and probs.device.type == "cpu":
        # a few rows' context states: Python ints beat a dozen tiny tensor ops per round
        states = torch.tensor(
            [reference_context_state(k, list(c)) for k, c in zip(keys, contexts)],
            dtype=torch.int64,
        )
        key_words = torch.tensor([split_key(k) for k in keys], dtype=torch.int64)
        return argmax_op(probs.float().contiguous(), states, key_words).to(probs.device)
    out = torch.empty(len(keys), dtype=torch.long, device=probs.device)
    for key in set(keys):
        idx = [i for i, k in enumerate(keys) if k == key]
        u = keyed_uniforms(key, [contexts[i] for i in idx], probs.shape[1], device)
        out[idx] = (probs[idx].float() / -torch.log(u)).argmax(dim=-1)
    return out
