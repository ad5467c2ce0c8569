"""Incremental detokenization and stop-string detection for one sequence."""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

from minivllm.sampling_params import SamplingParams


class IncrementalDetokenizer:
    """Turns each new token into text as it arrives.

    With a fast tokenizer, `tokenizers.DecodeStream` buffers partial UTF-8
    sequences; otherwise the whole output is re-decoded and the new suffix kept.
    Either way the text equals `tokenizer.decode(output_ids)` up to a stop string.
    """

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.output_text = ""
        self.token_ids: list[int] = []
        self.num_sent_chars = 0
        self.num_consumed = 0  # of the tokens passed to the last update()
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.backend = backend
        self.stream = (
            DecodeStream(skip_special_tokens=params.skip_special_tokens) if backend else None
        )
        # While streaming, hold back text that could still become the start of a stop string.
        self.holdback = (
            0 if params.include_stop_str_in_output else max(params.max_stop_str_len - 1, 0)
        )

    def update(self, new_token_ids: list[int], stop_terminated: bool, finished: bool) -> str | None:
        """Decode new tokens; return the stop string that ended the text, if one did.

        A token that ended the request through `stop_token_ids` is not turned
        into text unless `include_stop_str_in_output` (vLLM's rule). When the
        request ends, bytes still buffered as incomplete UTF-8 are flushed the
        way `tokenizer.decode` renders them.
        """
        if stop_terminated and not self.params.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        # Several tokens at once (speculative decoding): a stop string is looked for after
        # each, so the output ends at the token that completed it; `num_consumed` says how
        # many of the new tokens the text took.
        self.num_consumed = len(new_token_ids)
        start_len = len(self.output_text)
        for i, token_id in enumerate(new_token_ids):
            old_len = len(self.output_text)
            self.token_ids.append(token_id)
            self.output_text += self._decode_next(token_id)
            stop = self._check_stop(old_len)
            if stop is not None:
                self.num_consumed = i + 1
                return stop
        if finished:
            self._flush()  # bytes held as incomplete UTF-8 may complete a stop string
            return self._check_stop(start_len)
        return None

    def _check_stop(self, old_len: int) -> str | None:
        if not self.params.stop or len(self.token_ids) <= self.params.min_tokens:
            return None
        return self._find_stop(old_len)

    def _flush(self) -> None:
        full = self.tokenizer.decode(
            self.token_ids, skip_special_tokens=self.params.skip_special_tokens
        )
        if full.startswith(self.output_text):
            self.output_text = full

    def _decode_next(self, token_id: int) -> str:
        if self.stream is not None:
            return self.stream.step(self.backend, token_id) or ""
        full = self.tokenizer.decode(
            self.token_ids, skip_special_tokens=self.params.skip_special_tokens
        )
        if full.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        piece = full[len(self.output_text) :]
        return piece

    def _find_stop(self, old_len: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            begin = max(0, old_len - len(stop) + 1)
            index = self.output_text.find(stop, begin)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        end = index + len(stop) if self.params.include_stop_str_in_output else index
        self.output_text = self.output_text[:end]
        return stop

    def next_text(self, finished: bool, delta: bool) -> str:
        """The text to report now: all of it, or only what is new since the last call."""
        visible = (
            len(self.output_text) if finished else max(len(self.output_text) - self.holdback, 0)
        )
        visible = max(visible, self.num_sent_chars)
        if not delta:
            return self.output_text[:visible]
        text = self.output_text[self.num_sent_chars : visible]
        self.num_sent_chars = visible
        return text
