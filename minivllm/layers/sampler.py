"""From logits to tokens: penalties, temperature, min-p, top-k, top-p, then the draw.

Order follows vLLM: logit bias and min-tokens masking, then penalties; greedy
rows take the argmax; the others are divided by temperature, filtered by min-p,
top-k and top-p, and drawn with the exponential race (argmax of p_i / E_i with
E_i ~ Exp(1), which picks i with probability p_i; the Gumbel-max trick in another
form). Seeded rows draw E from their own generator, so their tokens do not
depend on the rest of the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters for one step (row = a request that samples)."""

    temperature: torch.Tensor  # [B], 1.0 on greedy rows
    is_greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    top_k: torch.Tensor | None = None  # [B] int, vocab size where off
    top_p: torch.Tensor | None = None  # [B]
    min_p: torch.Tensor | None = None  # [B]
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    presence_penalty: torch.Tensor | None = None  # [B]
    frequency_penalty: torch.Tensor | None = None  # [B]
    repetition_penalty: torch.Tensor | None = None  # [B]
    output_token_counts: torch.Tensor | None = None  # [B, V]
    prompt_token_mask: torch.Tensor | None = None  # [B, V] bool
    # [B, V] bool: prompt or output tokens, the only ones penalties change
    seen_token_mask: torch.Tensor | None = None
    logit_bias: torch.Tensor | None = None  # [B, V]
    # rows still under min_tokens -> token ids they may not produce yet
    banned_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # [B, ceil(V / 32)] int32: bit t of row b set where a grammar lets row b produce t
    token_bitmask: torch.Tensor | None = None


class Sampler:
    def __init__(
        self,
        generator: torch.Generator,
        argmax_kernel: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.generator = generator  # for rows without a seed
        # bf16 logits [B, V] -> argmax [B] without an fp32 copy (the CPU kernels' argmax_bf16)
        self.argmax_kernel = argmax_kernel

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        if (
            meta.all_greedy
            and self.argmax_kernel is not None
            and logits.dtype == torch.bfloat16
            and not changes_logits(meta)
        ):
            return self.argmax_kernel(logits)
        greedy, probs = self.target_distribution(logits, meta)
        if probs is None:
            return greedy
        sampled = self.draw(probs, meta.generators)
        return torch.where(meta.is_greedy, greedy, sampled)

    def target_distribution(
        self, logits: torch.Tensor, meta: SamplingMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every row's greedy token and, unless all rows are greedy, the probabilities the
        random rows draw from: after biases, penalties, temperature, min-p, top-k and top-p."""
        # a copy even where the logits are float32 already: the steps below work in place,
        # and the caller still reads the raw logits for logprobs
        logits = logits.to(torch.float32, copy=True)
        logits = self._apply_biases(logits, meta)
        logits = apply_penalties(logits, meta)
        greedy = logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy, None
        logits = logits / meta.temperature.unsqueeze(1)
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        if meta.top_k is not None or meta.top_p is not None:
            logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        return greedy, logits.softmax(dim=-1)

    def _apply_biases(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        if meta.logit_bias is not None:
            logits = logits + meta.logit_bias
        for row, token_ids in meta.banned_token_ids.items():
            logits[row, token_ids] = float("-inf")
        if meta.token_bitmask is not None:
            allowed = unpack_bitmask(meta.token_bitmask, logits.shape[-1])
            logits = logits.masked_fill_(~allowed, float("-inf"))
        return logits

    def draw(self, probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
        """One token per row from (possibly unnormalised) `probs`; row i draws its noise from
        `generators[i]` if given, else from the sampler's own generator."""
        noise = torch.empty_like(probs)
        if len(generators) < probs.shape[0]:
            noise.exponential_(generator=self.generator)
        for row, gen in generators.items():
            noise[row].exponential_(generator=gen)
        return (probs / noise).argmax(dim=-1)


def changes_logits(meta: SamplingMetadata) -> bool:
    """Whether biases, bans or penalties apply before the argmax."""
    return (
        meta.logit_bias is not None
        or meta.token_bitmask is not None
        or bool(meta.banned_token_ids)
        or meta.repetition_penalty is not None
        or meta.frequency_penalty is not None
    )


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, W] int32 words, token t at bit t % 32 of word t // 32 -> [B, vocab_size] bool."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    words = bitmask.to(device=bits.device, dtype=torch.int32).unsqueeze(-1)
    return ((words >> bits) & 1).bool().flatten(1)[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt and output tokens; divide positive logits, multiply negative),
    then frequency (x count) and presence (x seen) over output tokens, as OpenAI defines them.

    Only tokens in a row's prompt or output can change, so only those few entries are
    gathered, penalised and written back (in place), instead of passes over [B, V].
    """
    if meta.repetition_penalty is None and meta.frequency_penalty is None:
        return logits
    seen = meta.seen_token_mask
    if seen is None:
        seen = meta.output_token_counts > 0
        if meta.prompt_token_mask is not None:
            seen |= meta.prompt_token_mask
    rows, cols = seen.nonzero(as_tuple=True)
    values = logits[rows, cols]
    if meta.repetition_penalty is not None:
        penalty = meta.repetition_penalty[rows]
        values = torch.where(values > 0, values / penalty, values * penalty)
    if meta.frequency_penalty is not None:
        counts = meta.output_token_counts[rows, cols].to(values.dtype)
        values = values - meta.frequency_penalty[rows] * counts
        values = values - meta.presence_penalty[rows] * (counts > 0).to(values.dtype)
    logits[rows, cols] = values
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep the k most likely tokens, then the smallest prefix of them whose mass reaches p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
    if top_k is not None:
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # the first token is always kept
        sorted_logits = sorted_logits.masked_fill(
            (mass_before >= top_p.unsqueeze(1)) & (ranks > 0), float("-inf")
        )
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
