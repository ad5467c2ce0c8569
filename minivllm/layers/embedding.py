"""Vocabulary-parallel token embedding and LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.distributed.parallel_state import (
    get_tp_rank,
    get_tp_size,
    tp_all_gather,
    tp_all_reduce,
)
from minivllm.layers.linear_method import LinearMethodBase, UnquantizedLinearMethod, WeakLoader
from minivllm.layers.panel_linear import panel_rows


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary (the last one zero-padded)."""

    # read by lookups only, never multiplied: a quantized table keeps the rows `lookup`
    # reads and no GEMM copies (QuantizedLinearMethod.use); the LM head multiplies
    is_lookup_table = True

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.shard_size = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        # the weight's shape as a linear layer's (the LM head's x @ W.T), for quantization
        self.input_size, self.output_size = hidden_size, self.shard_size
        if not hasattr(self, "quant_method"):  # the LM head sets its own first
            # a quantized table (an explicit `embed_tokens` target) is read through `embed`
            self.quant_method: LinearMethodBase = UnquantizedLinearMethod()
        self.create_weights(hidden_size)

    def create_weights(self, hidden_size: int) -> None:
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = WeakLoader(self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        if loaded.shape[0] != self.vocab_size or loaded.shape[1] != param.shape[1]:
            raise ValueError(
                f"checkpoint tensor has shape {tuple(loaded.shape)}, "
                f"expected ({self.vocab_size}, {param.shape[1]})"
            )
        shard = loaded[self.vocab_start : self.vocab_start + self.shard_size]
        param.data[: shard.shape[0]].copy_(shard)
        param.data[shard.shape[0] :].zero_()  # the last rank's padding rows

    def weight_loader_ref(self) -> WeakLoader:
        return WeakLoader(self.weight_loader)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        embed = getattr(self.quant_method, "embed", None)
        if embed is not None:
            return embed(self, ids)
        if self.weight.dim() == 3:  # tied to an LM head that holds bf16 panels
            return panel_rows(self.weight, ids)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.lookup(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        out = self.lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over this rank's vocabulary slice, gathered to the full vocabulary.

    Its weight belongs to `quant_method`, as a linear layer's does (with tied
    embeddings the model then points `weight` at the embedding's).
    """

    is_lookup_table = False

    def __init__(
        self, vocab_size: int, hidden_size: int, quant_method: LinearMethodBase | None = None
    ) -> None:
        self.quant_method = quant_method or UnquantizedLinearMethod()
        super().__init__(vocab_size, hidden_size)

    def create_weights(self, hidden_size: int) -> None:
        self.quant_method.create_weights(
            self, hidden_size, self.shard_size, WeakLoader(self.weight_loader)
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.quant_method.apply(self, hidden, None)
        logits = tp_all_gather(local, dim=-1)
        return logits[..., : self.vocab_size]
