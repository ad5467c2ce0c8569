"""Held-out measurements of the demo models: loss, draft agreement, samples."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

SAMPLE_PROMPTS = [
    "The for statement in Python",
    "A dictionary is",
    "To open a file for reading,",
    "This module provides",
]


def heldout_windows(
    stream: torch.Tensor, seq_len: int, max_windows: int | None = None
) -> torch.Tensor:
    """Non-overlapping ``seq_len`` windows of the held-out stream, evenly thinned to ``max_windows``."""
    num_windows = len(stream) // seq_len
    windows = stream[: num_windows * seq_len].view(num_windows, seq_len)
    if max_windows is not None and num_windows > max_windows:
        windows = windows[torch.linspace(0, num_windows - 1, max_windows).long()]
    return windows


@torch.no_grad()
def heldout_loss(model: nn.Module, windows: torch.Tensor, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy (nats/token) over all positions of ``windows``."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for batch in windows.split(batch_size):
        logits = model(input_ids=batch).logits[:, :-1].float()
        targets = batch[:, 1:]
        total += nn.functional.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), reduction="sum"
        ).item()
        count += targets.numel()
    model.train(was_training)
    return total / count


@torch.no_grad()
def greedy_agreement(
    draft: nn.Module, target: nn.Module, windows: torch.Tensor, batch_size: int = 16
) -> float:
    """Share of held-out positions where draft and target agree on the argmax next token.

    With teacher forcing on real text this is the per-token acceptance rate of
    greedy speculative decoding (a draft token is accepted iff it equals the
    target's argmax), ignoring the drift of the proposed continuation.
    """
    agree, count = 0, 0
    for batch in windows.split(batch_size):
        draft_ids = draft(input_ids=batch).logits.argmax(dim=-1)
        target_ids = target(input_ids=batch).logits.argmax(dim=-1)
        agree += (draft_ids == target_ids).sum().item()
        count += batch.numel()
    return agree / count


@torch.no_grad()
def greedy_samples(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    max_new_tokens: int = 48,
) -> list[str]:
    """Greedy continuations of ``prompts`` (prompt text included)."""
    texts = []
    for prompt in prompts:
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
        output = model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False)
        texts.append(str(tokenizer.decode(output[0], skip_special_tokens=True)))
    return texts
