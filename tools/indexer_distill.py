"""KL distillation of the DeepSeek Sparse Attention lightning indexer.

transformers runs the indexer under ``torch.no_grad`` (top-k selection has no
gradient), so the indexer is trained the way DeepSeek-V3.2 trains it
(DeepSeek-V3.2-Exp report, sec. 2.1): its scores are pulled towards the main
attention distribution, summed over heads and L1-normalised,

    p[t, :] = sum_h A[h, t, :] / H
    L_I     = sum_t KL(p[t, :] || softmax(I[t, :]))

with the indexer input detached from the language-model graph. In the dense
warm-up the indexer selects every key, so ``p`` is the full causal attention;
in sparse training ``p`` is zero outside the selected keys and the KL is taken
over the selected set only, as in the report.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
    DeepseekV32Attention,
    DeepseekV32Indexer,
    apply_rotary_pos_emb,
)


def index_logits(
    indexer: DeepseekV32Indexer,
    hidden_states: torch.Tensor,
    q_resid: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """The indexer score I[b, s, t] = sum_h w[b, s, h] * relu(q[b, s, h] . k[b, t]), with gradient."""
    batch_size, seq_len, _ = hidden_states.shape
    rope_dim, head_dim = indexer.qk_rope_head_dim, indexer.head_dim
    q = indexer.wq_b(q_resid).view(batch_size, seq_len, indexer.n_heads, head_dim)
    k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)
    q_rot, q_pass = q.split([rope_dim, head_dim - rope_dim], dim=-1)
    k_rot, k_pass = k.split([rope_dim, head_dim - rope_dim], dim=-1)
    cos, sin = position_embeddings
    q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1).float()
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2).float()
    scores = F.relu(q @ k.transpose(-1, -2).unsqueeze(1)) * indexer.softmax_scale  # [B, S, H, T]
    weights = indexer.weights_proj(hidden_states).float() * indexer.n_heads**-0.5
    return (weights.unsqueeze(-2) @ scores).squeeze(-2)  # [B, S, T]


def kl_to_attention(logits: torch.Tensor, attn_probs: torch.Tensor) -> torch.Tensor:
    """Mean over queries of KL(p || softmax(logits restricted to keys where p > 0))."""
    target = attn_probs.float().mean(dim=1)  # [B, S, T], heads averaged
    keep = target > 0
    log_q = torch.log_softmax(logits.masked_fill(~keep, float("-inf")), dim=-1)
    log_q = log_q.masked_fill(~keep, 0.0)
    kl = torch.xlogy(target, target) - target * log_q
    return kl.sum(dim=-1).mean()


class IndexerDistiller:
    """Hooks every DSA attention layer to collect indexer inputs and attention maps.

    Needs ``attn_implementation="eager"`` so attention layers return their weights.
    """

    def __init__(self, model: nn.Module) -> None:
        self.attentions = [m for m in model.modules() if isinstance(m, DeepseekV32Attention)]
        self.inputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self.probs: dict[int, torch.Tensor] = {}
        for idx, attn in enumerate(self.attentions):
            attn.indexer.register_forward_pre_hook(self._save_inputs(idx), with_kwargs=True)
            attn.register_forward_hook(self._save_probs(idx))

    def _save_inputs(self, idx: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            hidden_states, q_resid, (cos, sin) = args[0], args[1], args[2]
            self.inputs[idx] = (hidden_states.detach(), q_resid.detach(), cos, sin)

        return hook

    def _save_probs(self, idx: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: tuple[Any, ...]) -> None:
            self.probs[idx] = output[1].detach()

        return hook

    def set_topk(self, topk: int) -> None:
        for attn in self.attentions:
            attn.indexer.index_topk = topk

    def loss(self) -> torch.Tensor:
        """KL loss summed over layers for the last forward pass."""
        total = torch.zeros(())
        for idx, attn in enumerate(self.attentions):
            hidden_states, q_resid, cos, sin = self.inputs[idx]
            logits = index_logits(attn.indexer, hidden_states, q_resid, (cos, sin))
            total = total + kl_to_attention(logits, self.probs[idx])
        self.inputs.clear()
        self.probs.clear()
        return total
