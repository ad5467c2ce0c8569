"""The watermark's keyed pseudorandom function: vLLM's `philox4x32-10-v1` input mapping.

Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011,
doi:10.1145/2063384.2063405) is a counter-based generator: 4 x 32-bit counter words
and 2 x 32-bit key words in, 4 words out, ten rounds of two 32x32->64 multiplies.
It is fast and vectorises, but it is not a cryptographic PRF: the watermark key
resists casual guessing, not key recovery or forgery.

The mapping (bit-compatible with vLLM, so either side detects the other's text):

- key K (0 <= K < 2^64): k0 = low 32 bits, k1 = high 32 bits.
- the context (the h previous generated token ids, -1 = "before the first") is absorbed
  four words at a time: state = ("WMCX", h, 0, 0); for the block at offset o, missing
  slots i of a short last block read 0xFFFFFFFF - i; state = Philox(state ^ block,
  key=(k0 ^ o, k1)).
- token v: Philox(counter=(v >> 2, s0, s1, s2), key=(k0 ^ s3, k1 ^ "WMTK")) and the
  output word v & 3 (one call serves four consecutive ids).
- uniform: the word's top 24 bits m give u = (m + 1) / (2^24 + 1), computed in float64
  and rounded to float32, so 0 < u < 1 strictly.

`philox_uniform` computes u for whole vocabularies with int64 tensor arithmetic on
32-bit lanes (any device); `reference_uniform` is the same function on Python ints,
one value at a time, for the compatibility vectors in the tests.
"""

from __future__ import annotations

import torch

VERSION = "philox4x32-10-v1"
MASK32 = 0xFFFFFFFF
MUL0, MUL1 = 0xD2511F53, 0xCD9E8D57  # round multipliers
WEYL0, WEYL1 = 0x9E3779B9, 0xBB67AE85  # key schedule increments
ROUNDS = 10
CONTEXT_DOMAIN = 0x574D4358  # "WMCX"
TOKEN_DOMAIN = 0x574D544B  # "WMTK"
SENTINEL = -1  # a context slot before the first generated token (0xFFFFFFFF as uint32)


def split_key(key: int) -> tuple[int, int]:
    if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < 2**64:
        raise ValueError("a watermark key is an integer with 0 <= key < 2**64")
    return key & MASK32, key >> 32


# --- Python ints: the reference ---


def reference_philox(counter: tuple[int, ...], key: tuple[int, int]) -> tuple[int, ...]:
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(ROUNDS):
        p0, p1 = MUL0 * c0, MUL1 * c2
        c0, c1, c2, c3 = (
            (p1 >> 32) ^ c1 ^ k0,
            p1 & MASK32,
            (p0 >> 32) ^ c3 ^ k1,
            p0 & MASK32,
        )
        if r < ROUNDS - 1:
            k0, k1 = (k0 + WEYL0) & MASK32, (k1 + WEYL1) & MASK32
    return c0, c1, c2, c3


def reference_context_state(key: int, context: list[int]) -> tuple[int, ...]:
    k0, k1 = split_key(key)
    words = [t & MASK32 for t in context]
    state = (CONTEXT_DOMAIN, len(words), 0, 0)
    for offset in range(0, len(words), 4):
        block = [words[offset + i] if offset + i < len(words) else MASK32 - i for i in range(4)]
        counter = tuple(s ^ b for s, b in zip(state, block))
        state = reference_philox(counter, (k0 ^ offset, k1))
    return state


def reference_word(key: int, context: list[int], token: int) -> int:
    k0, k1 = split_key(key)
    s0, s1, s2, s3 = reference_context_state(key, context)
    out = reference_philox((token >> 2, s0, s1, s2), (k0 ^ s3, k1 ^ TOKEN_DOMAIN))
    return out[token & 3]


def reference_uniform(key: int, context: list[int], token: int) -> float:
    m = reference_word(key, context, token) >> 8
    return float(torch.tensor((m + 1) / (2**24 + 1), dtype=torch.float64).float())


# --- tensors: the engine's path ---


def _mul_hi_lo(mul: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of mul * x for 32-bit lanes held in int64 (no overflow:
    the product is assembled from 16-bit pieces)."""
    x_lo, x_hi = x & 0xFFFF, x >> 16
    m_lo, m_hi = mul & 0xFFFF, mul >> 16
    low_part = x_lo * m_lo
    middle = x_hi * m_lo + x_lo * m_hi  # < 2^33
    low_sum = low_part + ((middle & 0xFFFF) << 16)
    high = (x_hi * m_hi + (middle >> 16) + (low_sum >> 32)) & MASK32
    return high, low_sum & MASK32


def philox(
    counter: tuple[torch.Tensor, ...], key: tuple[torch.Tensor | int, torch.Tensor | int]
) -> tuple[torch.Tensor, ...]:
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(ROUNDS):
        hi0, lo0 = _mul_hi_lo(MUL0, c0)
        hi1, lo1 = _mul_hi_lo(MUL1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        if r < ROUNDS - 1:
            k0, k1 = (k0 + WEYL0) & MASK32, (k1 + WEYL1) & MASK32
    return c0, c1, c2, c3


def context_states(key: int, contexts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The absorbed state (4 words) of each row of `contexts` [rows, h] (int64 token ids)."""
    k0, k1 = split_key(key)
    rows, width = contexts.shape
    words = contexts.to(torch.int64) & MASK32
    zeros = torch.zeros(rows, dtype=torch.int64, device=contexts.device)
    state = (zeros + CONTEXT_DOMAIN, zeros + width, zeros, zeros)
    for offset in range(0, width, 4):
        block = [
            words[:, offset + i] if offset + i < width else zeros + (MASK32 - i) for i in range(4)
        ]
        state = philox(tuple(s ^ b for s, b in zip(state, block)), (k0 ^ offset, k1))
    return state


def philox_uniform(key: int, contexts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """u[r, j] for context row r and token id tokens[r, j] (or tokens[j] for every row):
    float32, strictly inside (0, 1)."""
    k0, k1 = split_key(key)
    s0, s1, s2, s3 = (w.unsqueeze(1) for w in context_states(key, contexts))
    tokens = tokens.to(torch.int64)
    if tokens.dim() == 1:
        tokens = tokens.unsqueeze(0)
    tokens = tokens.expand(s0.shape[0], -1)
    outs = philox((tokens >> 2, s0.expand_as(tokens), s1, s2), (k0 ^ s3, k1 ^ TOKEN_DOMAIN))
    lane = tokens & 3
    word = torch.where(lane == 0, outs[0], outs[1])
    word = torch.where(lane == 2, outs[2], word)
    word = torch.where(lane == 3, outs[3], word)
    return (((word >> 8).to(torch.float64) + 1.0) / (2**24 + 1)).to(torch.float32)


def vocab_uniforms(key: int, contexts: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u[r, v] for every token id v < vocab_size: `philox_uniform` over the whole
    vocabulary, with one Philox call per four ids (their four output words) instead of four."""
    k0, k1 = split_key(key)
    s0, s1, s2, s3 = (w.unsqueeze(1) for w in context_states(key, contexts))
    groups = torch.arange((vocab_size + 3) // 4, dtype=torch.int64, device=contexts.device)
    groups = groups.unsqueeze(0).expand(s0.shape[0], -1)
    words = philox((groups, s0.expand_as(groups), s1, s2), (k0 ^ s3, k1 ^ TOKEN_DOMAIN))
    word = torch.stack(words, dim=2).flatten(1)[:, :vocab_size]  # id 4g + j <- word j of g
    return (((word >> 8).to(torch.float64) + 1.0) / (2**24 + 1)).to(torch.float32)
