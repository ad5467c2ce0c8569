"""The benchmark tokenizer padding: every id decodes to text, ordinary text encodes as before."""

from __future__ import annotations

from minivllm.utils.random_checkpoint import pad_tokenizer, train_bpe_tokenizer


def test_padded_tokenizer_gives_every_id_a_text():
    small = train_bpe_tokenizer(vocab_size=300)
    padded = pad_tokenizer(small, 2000)
    assert len(small) == 300 and len(padded) == 2000
    text = "def main():\n    return 0"
    assert padded(text)["input_ids"] == small(text)["input_ids"]
    assert padded.decode([1999]) == "<t1999>"
    assert padded.decode([5, 700, 6]) == small.decode([5]) + "<t700>" + small.decode([6])
    assert padded.eos_token == small.eos_token and padded.chat_template == small.chat_template
