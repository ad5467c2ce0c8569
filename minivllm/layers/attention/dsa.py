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


def gather_rows(device_rows: torch.Tensor, host_rows: torch.Tensor | None, rows: torch.Tensor):
    """Rows of a two-tier cache by flat row id: ids below `len(device_rows)` name device
    rows, the rest host rows (HiSparse's host pool; None or empty without one)."""
    num_device = device_rows.shape[0]
    if host_rows is None or host_rows.shape[0] == 0 or rows.numel() == 0:
        return device_rows[rows]
    on_host = rows >= num_device
    if not bool(on_host.any()):
        return device_rows[rows]
    out = device_rows[rows.clamp(max=num_device - 1)]
    out[on_host] = host_rows[rows[on_host] - num_device]
    return out


def indexer_topk(
    index_q: torch.Tensor,
    index_w: torch.Tensor,
    key_rows: torch.Tensor,
    row_req: torch.Tensor,
    positions: torch.Tensor,
    keys: torch.Tensor,
    host_keys: torch.Tensor | None,
    topk: int,
    scale: float,
) -> torch.Tensor:
    """The tokens each query row attends to, as token indices in ascending order,
    -1-padded: [N, topk] int64.

    index_q [N, Hi, Di], index_w [N, Hi] float32: query row n's indexer inputs; it
    belongs to request `row_req[n]` and sits at `positions[n]`, so it sees tokens
    0..positions[n], whose keys are rows `key_rows[row_req[n], t]` of `keys` (or of
    `host_keys`, see `gather_rows`). A row that sees at most `topk` tokens keeps them
    all; otherwise the `topk` best by I(s, t), ties going to the earlier token.

    Ties are common, not theoretical: a key that every index head's ReLU zeroes scores
    exactly 0, and `torch.topk` breaks ties differently for rows of different lengths
    (transformers' own output at a position changes with the length of the sequence
    after it). A fixed rule keeps chunked prefill, decode and prefill agreeing.
    """
    num = index_q.shape[0]
    out = torch.full((num, topk), -1, dtype=torch.long, device=index_q.device)
    for b in row_req.unique().tolist():
        sel = (row_req == b).nonzero().flatten()
        pos = positions[sel]
        length = int(pos.max()) + 1
        ar = torch.arange(length, device=index_q.device)
        visible = ar <= pos.unsqueeze(1)  # [n, length]
        if length <= topk:
            out[sel, :length] = torch.where(visible, ar, -1)
            continue
        key = gather_rows(keys, host_keys, key_rows[b, :length])
        scores = indexer_scores(index_q[sel], index_w[sel], key, scale)
        scores = scores.masked_fill(~visible, float("-inf"))
        chosen = scores.sort(dim=-1, descending=True, stable=True).indices[:, :topk]
        chosen = chosen.sort(dim=-1).values
        few = (pos + 1 <= topk).unsqueeze(1)  # rows seeing fewer: all visible ones
        chosen = torch.where(few, ar[:topk].expand_as(chosen), chosen)
        out[sel] = torch.where(chosen <= pos.unsqueeze(1), chosen, -1)
    return out


def selection_mask(indices: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[N, seq_len] bool from `indexer_topk`'s -1-padded token indices."""
    mask = torch.zeros(indices.shape[0], seq_len + 1, dtype=torch.bool, device=indices.device)
    mask.scatter_(1, torch.where(indices < 0, seq_len, indices), True)
    return mask[:, :seq_len]


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


def sparse_mla_decode(
    q_abs: torch.Tensor, latent: torch.Tensor, rows: torch.Tensor, kv_lora_rank: int, scale: float
) -> torch.Tensor:
    """The absorbed form over an index list: each query row n attends, with all heads,
    to the latent rows `rows[n]` of `latent` (-1: none). q_abs: [N, H, kv_lora + rope]
    (`absorb_query`); latent: [R, kv_lora + rope] -> p . c_kv, [N, H, kv_lora]; the
    caller applies W_UV."""
    valid = rows >= 0
    picked = latent[rows.clamp(min=0)]  # [N, K, D]
    scores = torch.matmul(q_abs, picked.transpose(1, 2)).float() * scale  # [N, H, K]
    scores.masked_fill_(~valid.unsqueeze(1), float("-inf"))
    probs = scores.softmax(dim=-1).to(latent.dtype)
    return torch.matmul(probs, picked[..., :kv_lora_rank])


def mla_decode(
    q: torch.Tensor,
    latent: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    rows: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The absorbed form, whole: q [N, H, nope + rope]; w_uk [H, nope, kv_lora];
    w_uv [H, v, kv_lora]; rows [N, K] into latent [R, kv_lora + rope] -> [N, H, v]."""
    out_lat = sparse_mla_decode(absorb_query(q, w_uk), latent, rows, w_uk.shape[2], scale)
    return torch.einsum("qhc,hvc->qhv", out_lat, w_uv)
