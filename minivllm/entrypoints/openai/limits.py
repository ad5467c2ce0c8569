"""How much one request may ask of the server: the operator's limits, in one place.

Every field of a request body has a fixed bound in `protocol.py`; the limits here
depend on the model or the deployment, so `minivllm serve` takes them as flags
(docs/limits.md lists both kinds). Each is checked before any work is queued, and
a request over one gets a 400 (or 429, for a full queue) that names the limit
and its flag.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

# A prompt of more characters than this many times the context window cannot fit:
# tokens average ~4 characters in text and rarely 16 even in whitespace-heavy code.
CHARS_PER_TOKEN_BOUND = 32
MIN_PROMPT_CHARS = 65536
MIN_LOGPROBS = 1 << 17


@dataclass(frozen=True)
class ServerLimits:
    # characters of one prompt (or of a conversation's messages), checked before
    # tokenizing; None: CHARS_PER_TOKEN_BOUND x max_model_len, at least MIN_PROMPT_CHARS
    max_prompt_chars: int | None = None
    # sequences one request starts: prompts x n
    max_sequences_per_request: int = 256
    # tokens one request may generate in all: prompts x n x max_tokens
    max_tokens_per_request: int = 1 << 20
    # log-probability values one response may carry: (echoed prompt tokens + max_tokens)
    # x (1 + logprobs) over every sequence; ~40-70 bytes of JSON each. None: enough for
    # one sequence filling the context with 20 top logprobs, at least MIN_LOGPROBS
    max_logprobs_per_request: int | None = None
    # sequences waiting for the engine across all clients; a request that would exceed
    # it gets 429 (retry later) instead of queueing behind minutes of work
    max_waiting_sequences: int = 1024

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and (isinstance(value, bool) or value < 1):
                raise ValueError(f"{f.name} must be >= 1, got {value!r}")

    def logprobs_per_request(self, max_model_len: int) -> int:
        if self.max_logprobs_per_request is not None:
            return self.max_logprobs_per_request
        return max(21 * max_model_len, MIN_LOGPROBS)

    def prompt_chars(self, max_model_len: int) -> int:
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return max(CHARS_PER_TOKEN_BOUND * max_model_len, MIN_PROMPT_CHARS)


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """`minivllm serve`'s flags for `ServerLimits` (torch-free, for a fast --help)."""
    group = parser.add_argument_group("request limits (docs/limits.md)")
    default = ServerLimits()
    group.add_argument(
        "--max-prompt-chars",
        metavar="N",
        type=int,
        default=None,
        help=f"characters of one prompt or conversation, checked before tokenizing "
        f"(default: {CHARS_PER_TOKEN_BOUND} x max-model-len, at least {MIN_PROMPT_CHARS})",
    )
    group.add_argument(
        "--max-sequences-per-request",
        metavar="N",
        type=int,
        default=default.max_sequences_per_request,
        help="sequences one request may start, prompts x n (default: %(default)s)",
    )
    group.add_argument(
        "--max-tokens-per-request",
        metavar="N",
        type=int,
        default=default.max_tokens_per_request,
        help="tokens one request may generate, prompts x n x max_tokens (default: %(default)s)",
    )
    group.add_argument(
        "--max-logprobs-per-request",
        metavar="N",
        type=int,
        default=None,
        help="log-probabilities one response may carry, echoed prompts included (default: "
        f"21 x max-model-len, one full-context sequence with 20 top logprobs; at least "
        f"{MIN_LOGPROBS})",
    )
    group.add_argument(
        "--max-waiting-seqs",
        metavar="N",
        type=int,
        default=default.max_waiting_sequences,
        help="sequences that may wait for the engine; requests beyond get 429 "
        "(default: %(default)s)",
    )


def limits_from(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(
        max_prompt_chars=args.max_prompt_chars,
        max_sequences_per_request=args.max_sequences_per_request,
        max_tokens_per_request=args.max_tokens_per_request,
        max_logprobs_per_request=args.max_logprobs_per_request,
        max_waiting_sequences=args.max_waiting_seqs,
    )
