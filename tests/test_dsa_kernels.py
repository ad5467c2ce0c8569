"""The DSA and MoE CPU kernels (dsa.cpp, moe.cpp) against their plain-PyTorch references:
indexer_topk, sparse_mla_decode (minivllm/layers/attention/dsa.py), moe_reference
(minivllm/layers/moe.py)."""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels.registry import select_kernels
from minivllm.layers.attention.dsa import (
    gather_rows,
    indexer_scores,
    indexer_topk,
    sparse_mla_decode,
)
from minivllm.layers.moe import moe_reference


def kernel(name: str):
    op = select_kernels("cpu", torch.bfloat16, True).op(name)
    if op is None:
        pytest.skip(f"no compiled {name} on this machine (needs AVX512-BF16 and a C++ compiler)")
    return op


def make_cache(gen, num_requests, max_len, num_device, num_host, dim):
    """Device and host key rows, and each request's token -> row id table drawn from both."""
    keys = torch.randn(num_device, dim, generator=gen).bfloat16()
    host = torch.randn(num_host, dim, generator=gen).bfloat16()
    key_rows = torch.stack(
        [
            torch.randperm(num_device + num_host, generator=gen)[:max_len]
            for _ in range(num_requests)
        ]
    )
    return keys, host, key_rows


def assert_same_selection(
    got, ref, index_q, index_w, key_rows, row_req, positions, keys, host, scale
):
    """Same format; the selected sets differ only in tokens whose reference scores are within
    1e-4 relative of the k-th best (fp32 sums in another order may swap near-ties)."""
    topk = ref.shape[1]
    for n in range(ref.shape[0]):
        length = int(positions[n]) + 1
        kept = got[n][got[n] >= 0]
        assert int((got[n] >= 0).sum()) == min(length, topk)
        assert bool((got[n, : len(kept)] >= 0).all()), "padding only at the end"
        assert bool((kept[1:] > kept[:-1]).all()), "ascending, no repeats"
        differ = set(kept.tolist()) ^ set(ref[n][ref[n] >= 0].tolist())
        if not differ:
            continue
        key = gather_rows(keys, host, key_rows[row_req[n], :length])
        scores = indexer_scores(index_q[n : n + 1], index_w[n : n + 1], key, scale)[0]
        kth = scores.sort(descending=True).values[topk - 1]
        for t in differ:
            assert abs(float(scores[t] - kth)) <= 1e-4 * abs(float(kth)), (n, t)


@pytest.mark.parametrize(
    "heads,dim,topk,num_host,max_len",
    [(4, 16, 8, 0, 300), (8, 64, 32, 50, 300), (16, 128, 64, 200, 1300), (70, 32, 16, 30, 300)],
)
def test_indexer_topk_matches_reference(heads, dim, topk, num_host, max_len):
    op = kernel("dsa_indexer_topk")
    gen = torch.Generator().manual_seed(heads * 100 + dim)
    keys, host, key_rows = make_cache(gen, 3, max_len, max_len + 100, num_host, dim)
    # request 0: a prefill chunk of rows at different positions; 1: one decode row;
    # 2: rows that see fewer tokens than topk (and one exactly topk)
    row_req = torch.tensor([0, 0, 0, 0, 1, 2, 2])
    last = max_len - 1
    positions = torch.tensor([last // 3, last // 3 + 1, 2 * last // 3, last, last - 43])
    positions = torch.cat((positions, torch.tensor([topk - 2, topk - 1])))
    num = len(row_req)
    index_q = torch.randn(num, heads, dim, generator=gen).bfloat16()
    index_w = torch.randn(num, heads, generator=gen) * heads**-0.5
    scale = dim**-0.5
    args = (index_q, index_w, key_rows, row_req, positions, keys, host if num_host else None)
    ref = indexer_topk(*args, topk, scale)
    got = op(*args, topk, scale)
    assert got.dtype == torch.long and got.shape == (num, topk)
    assert torch.equal(got[5:], ref[5:])  # all visible tokens, -1-padded
    assert_same_selection(got, ref, *args, scale)


def test_indexer_topk_takes_the_earlier_of_tied_tokens():
    """Keys opposite to every query score exactly 0 (all ReLUs zero): more of them than
    the places left, so the earliest must win, in rows of different lengths."""
    op = kernel("dsa_indexer_topk")
    gen = torch.Generator().manual_seed(7)
    heads, dim, topk, max_len = 8, 32, 16, 120
    positive = torch.zeros(max_len, dtype=torch.bool)
    positive[torch.randperm(max_len, generator=gen)[:10]] = True  # fewer than topk
    magnitude = torch.rand(max_len, dim, generator=gen) + 0.1
    keys = torch.where(positive.unsqueeze(1), magnitude, -magnitude).bfloat16()
    host = torch.rand(0, dim).bfloat16()
    key_rows = torch.stack([torch.arange(max_len), torch.arange(max_len).flip(0)])
    row_req = torch.tensor([0, 0, 0, 1, 1])
    positions = torch.tensor([40, 80, 119, 60, 119])
    num = len(row_req)
    index_q = (torch.rand(num, heads, dim, generator=gen) + 0.1).bfloat16()
    index_w = torch.rand(num, heads, generator=gen) + 0.1
    args = (index_q, index_w, key_rows, row_req, positions, keys, host, topk, dim**-0.5)
    ref = indexer_topk(*args)
    got = op(*args)
    assert torch.equal(got, ref)
    # request 0, row 2 sees everything: the positive tokens, then the earliest zeros
    zeros = (~positive).nonzero().flatten()[: topk - 10]
    expected = torch.cat((positive.nonzero().flatten(), zeros)).sort().values
    assert torch.equal(got[2], expected)


def test_indexer_topk_long_prefill_chunk():
    """More scores than the kernel holds at once (2^21): its rows go in several waves."""
    op = kernel("dsa_indexer_topk")
    gen = torch.Generator().manual_seed(11)
    heads, dim, topk, max_len, num = 4, 16, 256, 32768, 72
    keys, host, key_rows = make_cache(gen, 1, max_len, max_len, 0, dim)
    row_req = torch.zeros(num, dtype=torch.long)
    positions = torch.arange(max_len - num, max_len)
    index_q = torch.randn(num, heads, dim, generator=gen).bfloat16()
    index_w = torch.randn(num, heads, generator=gen) * heads**-0.5
    args = (index_q, index_w, key_rows, row_req, positions, keys, None)
    ref = indexer_topk(*args, topk, dim**-0.5)
    assert_same_selection(op(*args, topk, dim**-0.5), ref, *args, dim**-0.5)


def decode_inputs(gen, num, heads, kv_lora, rope, num_rows, num_index):
    dim = kv_lora + rope
    q_abs = torch.randn(num, heads, dim, generator=gen).bfloat16()
    latent = torch.randn(num_rows, dim, generator=gen).bfloat16()
    rows = torch.randint(0, num_rows, (num, num_index), generator=gen)
    return q_abs, latent, rows


def assert_decode_close(got, q_abs, latent, rows, kv_lora, scale):
    ref = sparse_mla_decode(q_abs.float(), latent.float(), rows, kv_lora, scale)
    empty = (rows < 0).all(dim=1)
    ref[empty] = 0.0  # the reference's softmax over nothing is NaN; the kernel writes 0
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize(
    "num,heads,kv_lora,rope,num_index",
    [(3, 4, 32, 8, 37), (4, 16, 64, 16, 300), (2, 5, 48, 16, 64), (1, 40, 32, 8, 1000)],
)
def test_sparse_mla_decode_matches_reference(num, heads, kv_lora, rope, num_index):
    op = kernel("sparse_mla_decode")
    gen = torch.Generator().manual_seed(num * 1000 + heads)
    q_abs, latent, rows = decode_inputs(gen, num, heads, kv_lora, rope, 500, num_index)
    rows[0, ::3] = -1  # scattered unused slots
    if num > 1:
        rows[-1, num_index // 2 :] = -1  # a row with fewer indices
    scale = (kv_lora + rope) ** -0.5
    assert_decode_close(
        op(q_abs, latent, rows, kv_lora, scale), q_abs, latent, rows, kv_lora, scale
    )


def test_sparse_mla_decode_rows_without_indices():
    """A row with no valid index writes zeros; so does a split of a long row's indices
    with none (a batch-1 row's index list is divided among the threads)."""
    op = kernel("sparse_mla_decode")
    gen = torch.Generator().manual_seed(3)
    q_abs, latent, rows = decode_inputs(gen, 3, 8, 64, 16, 300, 1024)
    rows[1] = -1
    rows[2, 10:] = -1
    scale = 80**-0.5
    got = op(q_abs, latent, rows, 64, scale)
    assert bool((got[1] == 0).all())
    assert_decode_close(got, q_abs, latent, rows, 64, scale)
    single = rows[2:3]
    assert_decode_close(
        op(q_abs[2:3], latent, single, 64, scale), q_abs[2:3], latent, single, 64, scale
    )


def test_sparse_mla_decode_real_shape():
    """DeepSeek-V3.2's latent (512 + 64) and index_topk 2048, 16 heads of a TP shard."""
    op = kernel("sparse_mla_decode")
    gen = torch.Generator().manual_seed(5)
    q_abs, latent, rows = decode_inputs(gen, 2, 16, 512, 64, 4096, 2048)
    q_abs = q_abs * 4  # peaked softmaxes as well as flat ones
    assert_decode_close(
        op(q_abs, latent, rows, 512, 576**-0.5), q_abs, latent, rows, 512, 576**-0.5
    )


@pytest.mark.parametrize("tokens", [1, 4, 37])
@pytest.mark.parametrize("hidden,inter,top_k", [(96, 48, 2), (100, 20, 6), (256, 128, 6)])
def test_moe_experts_match_reference(tokens, hidden, inter, top_k):
    op = kernel("moe_experts")
    gen = torch.Generator().manual_seed(tokens * 100 + hidden)
    num_experts = 8
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).bfloat16()
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5).bfloat16()
    weights = torch.rand(tokens, top_k, generator=gen)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)])
    ref = moe_reference(x.float(), w13.float(), w2.float(), weights, ids)
    got = op(x, w13, w2, weights, ids)
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    # h rounded to bf16 between the products, the output once: ~2^-8 of the output's scale
    torch.testing.assert_close(got.float(), ref, atol=1e-2 * float(ref.abs().max()), rtol=1e-2)


def test_kernels_refuse_bad_inputs():
    gen = torch.Generator().manual_seed(0)
    q_abs, latent, rows = decode_inputs(gen, 1, 4, 32, 8, 10, 4)
    rows[0, 1] = 10
    with pytest.raises(RuntimeError, match="outside"):
        kernel("sparse_mla_decode")(q_abs, latent, rows, 32, 1.0)
    x = torch.randn(1, 32).bfloat16()
    w13, w2 = torch.randn(2, 16, 32).bfloat16(), torch.randn(2, 32, 8).bfloat16()
    with pytest.raises(RuntimeError, match="expert id"):
        kernel("moe_experts")(x, w13, w2, torch.ones(1, 1), torch.tensor([[2]]))
