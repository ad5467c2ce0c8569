"""DeepSeek Sparse Attention (DSA) math in plain PyTorch: the reference every kernel is
checked against, and the path on machines without those kernels.

DSA (DeepSeek-V3.2-Exp report, 2025) adds a *lightning indexer* to multi-head latent
attention (MLA, DeepSeek-V2 report, arXiv:2405.04434). For query token s and every
visible token t it scores

    I(s, t) = sum_h w_h(s) * ReLU(q_h(s) . k(t) * index_head_dim^-0.5)

with `index_n_heads` small query heads q_h, one shared key k per token and per-token head
weights w_h (already scaled by index_n_heads^-0.5). The main attention then reads only the
`index_topk` best-scoring tokens. While a query sees at most `index_topk` tokens the
selection is all of them: attention is dense and the indexer need not run.

Attention itself comes in the two MLA forms, equal in exact arithmetic:

- prefill (the MHA form): up-project each selected latent c_kv through `kv_b_proj` into
  per-head keys and values, k = [k_nope | k_pe], then ordinary attention;
- decode (the absorbed form): fold `kv_b_proj`'s key half into the query,
  q_lat = q_nope W_UK, so every head attends over the 576-value latent row itself
  ([q_lat | q_pe] . [c_kv | k_pe]), and fold the value half into the output,
  out = (p . c_kv) W_UV^T. Nothing per head is ever materialised per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def indexer_scores(
    index_q: torch.Tensor, index_w: torch.Tensor, keys: torch.Tensor, scale: float
) -> torch.Tensor:
    """I(s, t) in float32. index_q: [Q, Hi, Di]; index_w: [Q, Hi] (float32, with the
    Hi^-0.5 factor); keys: [L, Di] -> [Q, L]. The order of operations is transformers'."""
    scores = torch.matmul(index_q.float(), keys.float().t()) * scale  # [Q, Hi, L]
    return torch.matmul(index_w.unsqueeze(1), F.relu(scores)).squeeze(1)


def topk_mask(
    scores: torch.Tensor | None, positions: torch.Tensor, seq_len: int, topk: int
) -> torch.Tensor:
    """Which of the first `seq_len` tokens each query attends to: the `topk` causally
    visible ones (t <= its position) with the best scores, all of them when a query sees
    at most `topk`. [Q, seq_len] bool; `scores` may be None when no query sees more.

    Ties are broken towards the earlier token. They are common, not theoretical: a key
    that every index head's ReLU zeroes scores exactly 0, so with few index heads many
    keys tie, and `torch.topk` breaks such ties differently for rows of different
    lengths (transformers' own output at a position then changes with the length of the
    sequence after it). A fixed rule keeps chunked prefill, decode and prefill agreeing.
    """
    causal = torch.arange(seq_len, device=positions.device) <= positions.unsqueeze(1)
    if seq_len <= topk:
        return causal
    ranked = scores.masked_fill(~causal, float("-inf"))
    chosen = ranked.sort(dim=-1, descending=True, stable=True).indices[:, :topk]
    selected = torch.zeros_like(causal).scatter_(1, chosen, True)
    return selected & causal


def mla_prefill(
    q: torch.Tensor,
    latent: torch.Tensor,
    kv_b_proj: torch.nn.Module,
    mask: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    v_head_dim: int,
) -> torch.Tensor:
    """The MHA form. q: [Q, H, nope + rope]; latent: [L, kv_lora + rope] (the tokens the
    mask's columns name); mask: [Q, L] -> [Q, H, v_head_dim]."""
    num_heads = q.shape[1]
    c_kv, k_pe = latent.split([kv_lora_rank, latent.shape[1] - kv_lora_rank], dim=-1)
    kv = kv_b_proj(c_kv).view(latent.shape[0], num_heads, -1)
    k_nope, value = kv.split([kv.shape[2] - v_head_dim, v_head_dim], dim=-1)
    key = torch.cat((k_nope, k_pe.unsqueeze(1).expand(-1, num_heads, -1)), dim=-1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        key.transpose(0, 1).unsqueeze(0),
        value.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        scale=scale,
    )
    return out[0].transpose(0, 1)


def absorb_query(q: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """[q_nope W_UK | q_pe]: q [Q, H, nope + rope], w_uk [H, nope, kv_lora] -> [Q, H, kv_lora + rope]."""
    nope = w_uk.shape[1]
    q_lat = torch.einsum("qhn,hnc->qhc", q[..., :nope], w_uk)
    return torch.cat((q_lat, q[..., nope:]), dim=-1)


def mla_decode(
    q: torch.Tensor,
    latent: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The absorbed form. q: [Q, H, nope + rope]; latent: [L, kv_lora + rope];
    w_uk: [H, nope, kv_lora]; w_uv: [H, v, kv_lora]; mask: [Q, L] -> [Q, H, v]."""
    kv_lora = w_uk.shape[2]
    q_abs = absorb_query(q, w_uk)  # [Q, H, 576]
    scores = torch.matmul(q_abs, latent.t()).float() * scale  # [Q, H, L]
    scores.masked_fill_(~mask.unsqueeze(1), float("-inf"))
    probs = scores.softmax(dim=-1).to(latent.dtype)
    out_lat = torch.matmul(probs, latent[:, :kv_lora])  # [Q, H, kv_lora]
    return torch.einsum("qhc,hvc->qhv", out_lat, w_uv)
