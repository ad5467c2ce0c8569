"""Engine-core outputs -> user-facing `RequestOutput`s (text, logprobs, n > 1 fan-in)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.engine.scheduler_output import EngineCoreOutput, TokenLogprobs
from minivllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from minivllm.sampling_params import SamplingParams


class OutputKind(enum.Enum):
    FINAL_ONLY = enum.auto()  # one output when the request ends (offline `generate`)
    DELTA = enum.auto()  # each output carries only the new tokens and text (streaming)
    CUMULATIVE = enum.auto()  # each output carries everything so far


@dataclass(eq=False)
class ParentRequest:
    """The user's request; it has one child sequence per sample (`n`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    kind: OutputKind
    metrics: RequestMetrics
    children: dict[int, ChildState] = field(default_factory=dict)
    child_ids: list[str] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())


@dataclass(eq=False)
class ChildState:
    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    num_sent_tokens: int = 0
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def child_request_id(parent_id: str, index: int, n: int) -> str:
    return parent_id if n == 1 else f"{index}_{parent_id}"


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentRequest] = {}
        self.child_to_parent: dict[str, tuple[ParentRequest, int]] = {}

    def add_request(
        self, parent: ParentRequest, child_ids: list[str], child_params: list[SamplingParams]
    ) -> None:
        self.parents[parent.request_id] = parent
        parent.child_ids = list(child_ids)
        for index, (child_id, params) in enumerate(zip(child_ids, child_params)):
            detok = IncrementalDetokenizer(self.tokenizer, params) if params.detokenize else None
            child = ChildState(index, detok)
            if params.logprobs is not None:
                child.logprobs, child.cumulative_logprob = [], 0.0
            parent.children[index] = child
            self.child_to_parent[child_id] = (parent, index)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.parents

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return list(parent.child_ids) if parent else []

    def abort(self, request_id: str) -> RequestOutput | None:
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for child in parent.children.values():
            if child.finish_reason is None:
                child.finish_reason = "abort"
        output = self._make_output(parent, list(parent.children.values()))
        self._forget(parent)
        return output

    def process(
        self, core_outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns user outputs, and the child ids a stop string finished (to free in the core)."""
        now = time.time()
        outputs, stopped = [], []
        for out in core_outputs:
            entry = self.child_to_parent.get(out.req_id)
            if entry is None:
                continue
            parent, index = entry
            child = parent.children[index]
            if self._update_child(parent, child, out, now):
                stopped.append(out.req_id)
            result = self._maybe_output(parent, child)
            if result is not None:
                outputs.append(result)
            if parent.finished:
                self._forget(parent)
        return outputs, stopped

    def _update_child(
        self, parent: ParentRequest, child: ChildState, out: EngineCoreOutput, now: float
    ) -> bool:
        metrics = parent.metrics
        if out.new_token_ids and metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        parent.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs:
            if parent.prompt_logprobs is None:
                parent.prompt_logprobs = [None]
            parent.prompt_logprobs.extend(self._convert(e) for e in out.prompt_logprobs)
        child.token_ids.extend(out.new_token_ids)
        if child.logprobs is not None and out.logprobs:
            for entry in out.logprobs:
                child.logprobs.append(self._convert(entry))
                child.cumulative_logprob += entry.logprobs[0]
        child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason
        hit_stop_string = False
        if child.detokenizer is not None and out.new_token_ids:
            stop_terminated = isinstance(out.stop_reason, int)
            stop_str = child.detokenizer.update(
                out.new_token_ids, stop_terminated, out.finish_reason is not None
            )
            if stop_str is not None and not stop_terminated:
                child.finish_reason, child.stop_reason = "stop", stop_str
                hit_stop_string = out.finish_reason is None
                self._drop_tokens_after_stop(child, len(out.new_token_ids), child.detokenizer)
        if parent.finished:
            metrics.finished_time = now
        return hit_stop_string

    @staticmethod
    def _drop_tokens_after_stop(child: ChildState, num_new: int, detokenizer: Any) -> None:
        """Tokens that arrived in the same step after the one completing a stop string
        (speculative decoding emits several) are not part of the output."""
        extra = num_new - detokenizer.num_consumed
        if extra <= 0:
            return
        dropped = child.token_ids[-extra:]
        del child.token_ids[-extra:]
        if child.logprobs is not None and len(child.logprobs) >= extra:
            for token_id, entry in zip(dropped, child.logprobs[-extra:]):
                child.cumulative_logprob -= entry[token_id].logprob
            del child.logprobs[-extra:]

    def _convert(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        decode = self.tokenizer.decode
        result = {
            tid: Logprob(lp, rank, decode([tid]))
            for rank, (tid, lp) in enumerate(zip(entry.token_ids[1:], entry.logprobs[1:]), start=1)
        }
        chosen = entry.token_ids[0]
        result[chosen] = Logprob(entry.logprobs[0], entry.rank, decode([chosen]))
        return result

    def _maybe_output(self, parent: ParentRequest, child: ChildState) -> RequestOutput | None:
        if parent.kind is OutputKind.FINAL_ONLY:
            if not parent.finished:
                return None
            return self._make_output(parent, list(parent.children.values()))
        return self._make_output(parent, [child])

    def _make_output(self, parent: ParentRequest, children: list[ChildState]) -> RequestOutput:
        delta = parent.kind is OutputKind.DELTA
        completions = [self._completion(c, delta) for c in sorted(children, key=lambda c: c.index)]
        prompt_logprobs = parent.prompt_logprobs
        if delta and prompt_logprobs is not None:
            parent.prompt_logprobs = []  # sent once
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=prompt_logprobs or None,
            outputs=completions,
            finished=parent.finished,
            metrics=parent.metrics,
            num_cached_tokens=parent.num_cached_tokens,
        )

    def _completion(self, child: ChildState, delta: bool) -> CompletionOutput:
        finished = child.finish_reason is not None
        text = child.detokenizer.next_text(finished, delta) if child.detokenizer else ""
        start = child.num_sent_tokens if delta else 0
        child.num_sent_tokens = len(child.token_ids)
        logprobs = child.logprobs[start:] if child.logprobs is not None else None
        return CompletionOutput(
            child.index,
            text,
            child.token_ids[start:],
            child.cumulative_logprob,
            logprobs,
            child.finish_reason,
            child.stop_reason,
        )

    def _forget(self, parent: ParentRequest) -> None:
        self.parents.pop(parent.request_id, None)
        for child_id in parent.child_ids:
            self.child_to_parent.pop(child_id, None)
