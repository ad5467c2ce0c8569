"""Random-weight HF checkpoints with a locally trained BPE tokenizer (no hub needed).

Used by the tests (tiny models) and the benchmarks (Qwen3-0.6B's shape), so that
anyone can rebuild exactly the checkpoint a figure was measured on.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from typing import Any

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3-0.6B's shape (the project's performance reference).
QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=True,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
)
_CORPUS_FILES = ("textwrap.py", "string.py", "glob.py", "fnmatch.py", "shlex.py", "difflib.py")


def stdlib_corpus() -> list[str]:
    """A few Python standard-library sources: text every machine with Python has."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [
        (stdlib / name).read_text(encoding="utf-8", errors="ignore")
        for name in _CORPUS_FILES
        if (stdlib / name).exists()
    ]


def train_bpe_tokenizer(vocab_size: int = 500, texts: list[str] | None = None) -> Any:
    """A byte-level BPE tokenizer as a transformers fast tokenizer, with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts if texts is not None else stdlib_corpus(), trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def pad_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """Give every id up to `vocab_size` a text (`<t1234>`), as plain BPE vocabulary entries.

    A random model of a real model's shape samples ids from its whole vocabulary; with a
    small trained tokenizer most of them would decode to nothing, and a streaming server
    sends nothing for a token without text, so serving benchmarks could not time them.
    Vocabulary entries (no merges reach them) load as fast as a real 150k vocabulary;
    150k *added* tokens would take seconds.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for i in range(len(tokenizer), vocab_size):
        vocab[f"<t{i}>"] = i
    padded = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        eos_token=tokenizer.eos_token,
        pad_token=tokenizer.pad_token,
    )
    padded.chat_template = tokenizer.chat_template
    return padded


def make_random_checkpoint(
    out: str | Path,
    config_class: str,
    config: dict[str, Any],
    tokenizer: Any,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    max_shard_size: str | None = None,
) -> Path:
    """Save a randomly initialised model of `config_class` (e.g. "Qwen3Config") plus `tokenizer`."""
    import transformers
    from transformers import AutoModelForCausalLM

    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    hf_config = getattr(transformers, config_class)(
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, **config
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()
    out = Path(out)
    model.save_pretrained(out, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    tokenizer.save_pretrained(out)
    return out
