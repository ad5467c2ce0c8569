"""Grammars compiled by xgrammar for one tokenizer and vocabulary, cached by their text."""

from __future__ import annotations

import functools
import json
from typing import Any

import torch

from minivllm.sampling_params import StructuredOutputsParams

# compiled grammars kept per backend (a JSON schema compiles in milliseconds to seconds)
CACHE_SIZE = 128


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - xgrammar is a dependency
        raise ValueError(
            "structured output needs the xgrammar package: pip install xgrammar"
        ) from e
    return xgrammar


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are the given strings."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarBackend:
    """Compiles `StructuredOutputsParams` into xgrammar `CompiledGrammar`s; raises
    ValueError (naming the field) for a schema, regex or grammar xgrammar refuses."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        # the engine's EOS ids end a finished grammar (the tokenizer's own may differ)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids) or None
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.compile = functools.lru_cache(maxsize=CACHE_SIZE)(self._compile)
        # Compact JSON never holds a raw control character (< 0x20; in strings they must
        # be escaped), yet xgrammar 0.2.9's token-level matching lets such tokens into
        # JSON strings (`"name": "\x17P"` was accepted), which strict parsers refuse:
        # JSON constraints also mask them.
        no_control = torch.tensor(
            [not any(b < 0x20 for b in text) for text in info.decoded_vocab[:vocab_size]]
            + [True] * max(vocab_size - len(info.decoded_vocab), 0)
        )
        self.no_control_mask = pack_bitmask(no_control)
        # a finished grammar on a request that keeps running (ignore_eos): EOS only
        eos_only = torch.zeros(vocab_size, dtype=torch.bool)
        eos_only[sorted(stop_token_ids)] = True
        self.eos_only_mask = pack_bitmask(eos_only)

    def extra_mask(self, params: StructuredOutputsParams) -> torch.Tensor | None:
        """What a request's rows are masked with besides its grammar (see no_control_mask)."""
        return self.no_control_mask if params.key()[0] in ("json", "json_object") else None

    def compiled(self, params: StructuredOutputsParams) -> Any:
        return self.compile(params.key())

    def _compile(self, key: tuple[str, str]) -> Any:
        kind, spec = key
        try:
            if kind == "json":
                return self.compiler.compile_json_schema(spec, any_whitespace=False)
            if kind == "json_object":  # OpenAI's json_object: an object, not any JSON value
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return self.compiler.compile_regex(spec)
            if kind == "choice":
                return self.compiler.compile_grammar(choice_grammar(json.loads(spec)))
            return self.compiler.compile_grammar(spec)  # "grammar": EBNF
        except Exception as e:  # xgrammar's C++ errors arrive as several exception types
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"structured_outputs.{kind} could not be compiled: {first}") from e


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """[V] bool -> [ceil(V / 32)] int32 words, token t at bit t % 32 of word t // 32
    (xgrammar's layout; `layers.sampler.unpack_bitmask` reads it back)."""
    padded = torch.zeros(-(-allowed.numel() // 32) * 32, dtype=torch.bool)
    padded[: allowed.numel()] = allowed
    weights = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int64)
    return (padded.view(-1, 32).long() * weights).sum(dim=1).to(torch.int32)
