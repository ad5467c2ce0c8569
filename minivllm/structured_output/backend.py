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
        self.no_control_mask = _no_control_mask(info.decoded_vocab, vocab_size)

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


def _no_control_mask(decoded_vocab: list[bytes], vocab_size: int) -> torch.Tensor:
    """[ceil(V / 32)] int32, bit t set unless token t's bytes hold a control character
    (< 0x20). Compact JSON never contains one raw (inside strings they must be escaped),
    yet xgrammar's token-level matching lets such tokens into JSON strings (seen with
    xgrammar 0.2.9: `"name": "\x17P"` accepted), which strict parsers then refuse."""
    allowed = torch.ones(-(-vocab_size // 32) * 32, dtype=torch.bool)
    for token, text in enumerate(decoded_vocab[:vocab_size]):
        if any(byte < 0x20 for byte in text):
            allowed[token] = False
    weights = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int64)
    words = (allowed.view(-1, 32).long() * weights).sum(dim=1)
    return words.to(torch.int32)
