"""The sampling state of the runner's requests, one row each, kept across steps (vLLM's `InputBatch`).

Per-row sampling tensors (temperature, top-k/p, min-p, penalties, the output
token counts and prompt masks the penalties read) are written when a request
arrives and updated with each sampled token, instead of being rebuilt from
Python lists every step. Rows are handed out in arrival order and compacted,
order kept, when requests leave:

    rows:  0:a  1:b  2:c  3:d         b and c finish
    rows:  0:a  1:d                   (a step's sampling rows a, d -> slices [0:2])

The scheduler lists running requests in the same order, so in a steady decode
batch the sampling rows are 0..B-1 and every tensor is a view; any other set
of rows is gathered.
"""

from __future__ import annotations

import torch

from minivllm.layers.sampler import SamplingMetadata
from minivllm.worker.request_state import CachedRequestState


class InputBatch:
    def __init__(self, max_num_reqs: int, vocab_size: int, device: str) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.capacity = max(max_num_reqs, 1)
        self.states: list[CachedRequestState] = []  # row -> request
        self.row_of: dict[str, int] = {}
        self.temperature = self._full(1.0, torch.float32)  # 1.0 on greedy rows
        self.top_k = self._full(vocab_size, torch.long)  # vocab size where off
        self.top_p = self._full(1.0, torch.float32)
        self.min_p = self._full(0.0, torch.float32)
        self.repetition_penalty = self._full(1.0, torch.float32)
        self.frequency_penalty = self._full(0.0, torch.float32)
        self.presence_penalty = self._full(0.0, torch.float32)
        # [capacity, vocab]: allocated when the first request with a penalty arrives
        self.output_token_counts: torch.Tensor | None = None
        self.prompt_token_mask: torch.Tensor | None = None
        self.seen_token_mask: torch.Tensor | None = None  # prompt or output tokens

    @property
    def num_reqs(self) -> int:
        return len(self.states)

    def _full(self, value: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((self.capacity,), value, dtype=dtype, device=self.device)

    def _per_row(self) -> list[str]:
        names = ["temperature", "top_k", "top_p", "min_p"]
        names += ["repetition_penalty", "frequency_penalty", "presence_penalty"]
        if self.output_token_counts is not None:
            names += ["output_token_counts", "prompt_token_mask", "seen_token_mask"]
        return names

    def add(self, state: CachedRequestState) -> None:
        if self.num_reqs == self.capacity:
            self._grow()
        row = self.num_reqs
        self.states.append(state)
        self.row_of[state.req_id] = row
        p = state.sampling_params
        self.temperature[row] = 1.0 if p.is_greedy else p.temperature
        self.top_k[row] = min(p.top_k, self.vocab_size) or self.vocab_size  # k > vocab: off
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.repetition_penalty[row] = p.repetition_penalty
        self.frequency_penalty[row] = p.frequency_penalty
        self.presence_penalty[row] = p.presence_penalty
        if self.output_token_counts is None and state.sampling_params.uses_penalties:
            self._allocate_penalty_state()  # fills every row, this one too
        elif self.output_token_counts is not None:
            self._fill_penalty_row(row)

    def remove(self, req_ids: set[str]) -> None:
        """Drop these requests' rows; the others move up, in order."""
        keep = [row for row, s in enumerate(self.states) if s.req_id not in req_ids]
        if len(keep) == self.num_reqs:
            return
        self.states = [self.states[row] for row in keep]
        self.row_of = {s.req_id: row for row, s in enumerate(self.states)}
        if keep != list(range(len(keep))):
            index = torch.tensor(keep, dtype=torch.long, device=self.device)
            for name in self._per_row():
                tensor = getattr(self, name)
                tensor[: len(keep)] = tensor[index]

    def record_sampled(self, req_ids: list[str], token_ids: list[int]) -> None:
        """Count each request's new output token (only while penalties are tracked)."""
        if self.output_token_counts is None or not req_ids:
            return
        rows = torch.tensor([self.row_of[r] for r in req_ids], device=self.device)
        tokens = torch.tensor(token_ids, device=self.device)
        ones = torch.ones(len(req_ids), dtype=torch.int32, device=self.device)
        self.output_token_counts.index_put_((rows, tokens), ones, accumulate=True)
        self.seen_token_mask[rows, tokens] = True

    def sampling_metadata(self, req_ids: list[str]) -> SamplingMetadata:
        """The sampling tensors of these requests' rows, in this order."""
        return self.metadata_for_rows([self.row_of[r] for r in req_ids])

    def metadata_for_rows(self, rows: list[int]) -> SamplingMetadata:
        """The sampling tensors of these rows, in this order; features no row uses stay
        None, so they cost nothing."""
        states = [self.states[row] for row in rows]
        params = [s.sampling_params for s in states]
        if rows == list(range(len(rows))):
            select = slice(0, len(rows))
        else:
            select = torch.tensor(rows, dtype=torch.long, device=self.device)
        is_greedy = [p.is_greedy for p in params]
        meta = SamplingMetadata(
            temperature=self.temperature[select],
            is_greedy=torch.tensor(is_greedy, device=self.device),
            all_greedy=all(is_greedy),
        )
        if any(p.top_k > 0 for p in params):
            meta.top_k = self.top_k[select]
        if any(p.top_p < 1.0 for p in params):
            meta.top_p = self.top_p[select]
        if any(p.min_p > 0.0 for p in params):
            meta.min_p = self.min_p[select]
        meta.generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        use_rep = any(p.repetition_penalty != 1.0 for p in params)
        use_freq = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params)
        if use_rep or use_freq:
            meta.output_token_counts = self.output_token_counts[select]
            meta.seen_token_mask = self.seen_token_mask[select]
        if use_rep:
            meta.prompt_token_mask = self.prompt_token_mask[select]
            meta.repetition_penalty = self.repetition_penalty[select]
        if use_freq:
            meta.frequency_penalty = self.frequency_penalty[select]
            meta.presence_penalty = self.presence_penalty[select]
        _add_biases(meta, states, self.vocab_size, self.device)
        return meta

    def metadata_for_verification(
        self, req_ids: list[str], drafts: list[list[int]]
    ) -> SamplingMetadata:
        """One row per verified position: request i's rows 0..len(drafts[i]); row j sees
        drafts[i][:j] as output tokens already (penalty counts, min_tokens bans)."""
        rows = [self.row_of[r] for r, d in zip(req_ids, drafts) for _ in range(len(d) + 1)]
        meta = self.metadata_for_rows(rows)  # repeated rows: gathered copies, safe to edit
        meta.banned_token_ids = {}
        out_row = 0
        for req_id, req_drafts in zip(req_ids, drafts):
            state = self.states[self.row_of[req_id]]
            for j in range(len(req_drafts) + 1):
                if j and meta.output_token_counts is not None:
                    token = req_drafts[j - 1]
                    meta.output_token_counts[
                        out_row : out_row + len(req_drafts) + 1 - j, token
                    ] += 1
                    meta.seen_token_mask[out_row : out_row + len(req_drafts) + 1 - j, token] = True
                banned = _banned_ids(state, len(state.output_token_ids) + j)
                if banned:
                    meta.banned_token_ids[out_row] = banned
                out_row += 1
        return meta

    def _allocate_penalty_state(self) -> None:
        shape = (self.capacity, self.vocab_size)
        self.output_token_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self.prompt_token_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        self.seen_token_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        for row in range(self.num_reqs):
            self._fill_penalty_row(row)

    def _fill_penalty_row(self, row: int) -> None:
        state = self.states[row]
        counts, mask = self.output_token_counts[row], self.prompt_token_mask[row]
        counts.zero_()
        mask.zero_()
        ids = torch.tensor(state.output_token_ids, dtype=torch.long, device=self.device)
        counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        mask[state.token_ids[: state.num_prompt_tokens]] = True
        torch.logical_or(mask, counts > 0, out=self.seen_token_mask[row])

    def _grow(self) -> None:
        old = self.capacity
        self.capacity = 2 * old
        for name in self._per_row():
            tensor = getattr(self, name)
            grown = torch.zeros(
                (self.capacity, *tensor.shape[1:]), dtype=tensor.dtype, device=self.device
            )
            grown[:old] = tensor
            setattr(self, name, grown)


def _add_biases(
    meta: SamplingMetadata, states: list[CachedRequestState], vocab_size: int, device: str
) -> None:
    """Logit bias (dense, only when some row has one) and the ids rows under min_tokens may not produce."""
    for row, state in enumerate(states):
        params = state.sampling_params
        if params.logit_bias:
            if meta.logit_bias is None:
                meta.logit_bias = torch.zeros(len(states), vocab_size, device=device)
            for token_id, bias in params.logit_bias.items():
                meta.logit_bias[row, token_id] = bias
        banned = _banned_ids(state, len(state.output_token_ids))
        if banned:
            meta.banned_token_ids[row] = banned


def _banned_ids(state: CachedRequestState, num_output_tokens: int) -> list[int]:
    """Stop and EOS ids a request may not produce while under `min_tokens`."""
    params = state.sampling_params
    if num_output_tokens >= params.min_tokens:
        return []
    banned = set(params.all_stop_token_ids)
    if not params.ignore_eos:
        banned |= state.eos_token_ids
    return sorted(banned)


def build_sampling_metadata(
    states: list[CachedRequestState], vocab_size: int, device: str
) -> SamplingMetadata:
    """One step's metadata for `states`, through a fresh batch (tests; the runner keeps its batch)."""
    batch = InputBatch(len(states), vocab_size, device)
    for state in states:
        batch.add(state)
    return batch.metadata_for_rows(list(range(len(states))))
