"""Train the byte-level BPE tokenizer shared by all demo models.

    python tools/train_tokenizer.py --corpus out/corpus --out out/tokenizer

Writes ``tokenizer.json`` plus ``tokenizer_config.json`` (with a ChatML chat
template) so that ``transformers.AutoTokenizer.from_pretrained(out)`` loads it.
BPE training in ``tokenizers`` is deterministic for a given corpus and vocab.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [EOS_TOKEN, "<|im_start|>", "<|im_end|>"]
DOC_SEPARATOR = "\n<|endoftext|>\n"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def read_documents(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").split(DOC_SEPARATOR)


def paragraphs(docs: list[str]) -> Iterator[str]:
    for doc in docs:
        yield from doc.split("\n\n")


def train_bpe(docs: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tokenizer.train_from_iterator(paragraphs(docs), trainer=trainer)
    return tokenizer


def save_for_transformers(tokenizer: Tokenizer, out: Path) -> None:
    """Write tokenizer.json and a tokenizer_config.json that transformers 4.x and 5.x both load."""
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "model_max_length": 1024,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=Path("out/corpus"))
    parser.add_argument("--out", type=Path, default=Path("out/tokenizer"))
    parser.add_argument("--vocab-size", type=int, default=4096)
    args = parser.parse_args()
    tokenizer = train_bpe(read_documents(args.corpus / "train.txt"), args.vocab_size)
    args.out.mkdir(parents=True, exist_ok=True)
    save_for_transformers(tokenizer, args.out)
    print(f"saved {tokenizer.get_vocab_size()} tokens to {args.out}")


if __name__ == "__main__":
    main()
