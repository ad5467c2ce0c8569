"""Sampling against direct computations of each definition (statistically where random)."""

from __future__ import annotations

import math

import pytest
import torch

from minivllm.layers.sampler import Sampler, SamplingMetadata, apply_penalties
from minivllm.sampling_params import SamplingParams
from minivllm.worker.input_batch import build_sampling_metadata
from minivllm.worker.request_state import CachedRequestState

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -3.0])
N = 40_000


def _states(params: SamplingParams, n: int, prompt=(1, 2), output=()) -> list[CachedRequestState]:
    def generator() -> torch.Generator | None:
        return None if params.seed is None else torch.Generator().manual_seed(params.seed)

    return [
        CachedRequestState(
            str(i),
            list(prompt) + list(output),
            len(prompt),
            params,
            [],
            0,
            frozenset({5}),
            generator(),
        )
        for i in range(n)
    ]


def _draw(params: SamplingParams, n: int = N) -> torch.Tensor:
    meta = build_sampling_metadata(_states(params, n), len(LOGITS), "cpu")
    gen = torch.Generator().manual_seed(0)
    return Sampler(gen)(LOGITS.expand(n, -1).clone(), meta)


def _assert_matches(samples: torch.Tensor, probs: torch.Tensor) -> None:
    """Every token's frequency within 5 standard errors of its probability; zero-prob tokens never drawn."""
    freq = torch.bincount(samples, minlength=len(probs)).double() / len(samples)
    for p, f in zip(probs.double().tolist(), freq.tolist()):
        if p == 0:
            assert f == 0
        else:
            assert abs(f - p) <= 5 * math.sqrt(p * (1 - p) / len(samples)) + 1e-12


def test_greedy_takes_the_argmax():
    assert _draw(SamplingParams(temperature=0), n=3).tolist() == [0, 0, 0]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature(temperature):
    _assert_matches(
        _draw(SamplingParams(temperature=temperature)), (LOGITS / temperature).softmax(-1)
    )


def test_top_k():
    probs = LOGITS.softmax(-1)
    probs[3:] = 0
    _assert_matches(_draw(SamplingParams(top_k=3)), probs / probs.sum())


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = LOGITS.softmax(-1)  # sorted descending already
    cumulative = probs.cumsum(0)
    top_p = float(cumulative[1]) + 0.01  # needs the first three tokens
    expected = probs.clone()
    expected[3:] = 0
    _assert_matches(_draw(SamplingParams(top_p=top_p)), expected / expected.sum())


def test_min_p():
    probs = LOGITS.softmax(-1)
    min_p = 0.3
    expected = torch.where(probs >= min_p * probs.max(), probs, torch.zeros_like(probs))
    _assert_matches(_draw(SamplingParams(min_p=min_p)), expected / expected.sum())


def test_top_k_top_p_and_temperature_compose():
    scaled = (LOGITS / 0.7).softmax(-1)
    scaled[4:] = 0  # top_k=4
    scaled = scaled / scaled.sum()
    keep = (scaled.cumsum(0) - scaled) < 0.8
    expected = torch.where(keep, scaled, torch.zeros_like(scaled))
    _assert_matches(
        _draw(SamplingParams(temperature=0.7, top_k=4, top_p=0.8)), expected / expected.sum()
    )


def test_penalties_follow_their_definitions():
    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25)
    output = [0, 0, 3, 4]
    states = _states(params, 1, prompt=(1, 4), output=output)
    meta = build_sampling_metadata(states, len(LOGITS), "cpu")
    got = apply_penalties(LOGITS.unsqueeze(0).clone(), meta)[0]
    expected = LOGITS.clone()
    for tok in range(len(LOGITS)):
        if tok in (1, 4) or tok in output:  # repetition: prompt and output tokens
            expected[tok] = expected[tok] / 1.3 if expected[tok] > 0 else expected[tok] * 1.3
        count = output.count(tok)  # frequency and presence: output tokens only
        expected[tok] -= 0.5 * count + (0.25 if count else 0.0)
    torch.testing.assert_close(got, expected)


def test_logit_bias_and_min_tokens():
    got = _draw(SamplingParams(temperature=0, logit_bias={4: 10.0}), n=2)
    assert got.tolist() == [4, 4]
    # token 5 is EOS for these states; a huge bias cannot pick it under min_tokens
    got = _draw(SamplingParams(temperature=0, logit_bias={5: 50.0}, min_tokens=3), n=2)
    assert got.tolist() == [0, 0]
    got = _draw(
        SamplingParams(
            temperature=0, logit_bias={5: 50.0}, min_tokens=3, ignore_eos=False, stop_token_ids=[0]
        ),
        n=1,
    )
    assert got.tolist() == [1]


def test_seeded_rows_do_not_depend_on_their_neighbours():
    params = SamplingParams(temperature=1.0, seed=42)
    alone_states = _states(params, 1)
    sampler = Sampler(torch.Generator().manual_seed(1))
    alone = [
        sampler(LOGITS.unsqueeze(0), build_sampling_metadata(alone_states, 6, "cpu")).item()
        for _ in range(30)
    ]
    states = _states(SamplingParams(temperature=1.0), 3) + _states(params, 1)
    sampler = Sampler(torch.Generator().manual_seed(9))
    mixed = [
        sampler(LOGITS.expand(4, -1).clone(), build_sampling_metadata(states, 6, "cpu"))[3].item()
        for _ in range(30)
    ]
    assert mixed == alone and len(set(alone)) > 1
    assert list(build_sampling_metadata(states, 6, "cpu").generators) == [3]
    assert isinstance(build_sampling_metadata(states, 6, "cpu"), SamplingMetadata)
