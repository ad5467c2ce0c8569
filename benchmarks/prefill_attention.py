"""Causal prefill attention per layer: the AMX-BF16 tile path against the AVX-512 one
(`kernels/prefill_attention.cpp`, the same op with `allow_amx=False`) and PyTorch's SDPA
on the same keys, for the Qwen3-0.6B shape (16 query heads, 8 KV heads, head_dim 128) at
several prompt lengths, the two variants interleaved.

    python benchmarks/prefill_attention.py                  # 128 512 2048 tokens
    python benchmarks/prefill_attention.py --tokens 4096 --heads 32 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from minivllm.kernels import get_cpu_kernels
from minivllm.kernels.isa import cpu_model, isa_summary


def timed_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--heads", type=int, nargs=2, default=[16, 8], metavar=("Q", "KV"))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = get_cpu_kernels()
    if kernels is None:
        raise SystemExit("this CPU has no bf16 kernels (AVX512-BF16 needed)")
    amx = kernels.amx_bf16_available()
    print(f"{cpu_model()} [{isa_summary()}], {args.threads} threads; AMX-BF16 usable: {amx}")
    print("median ms per layer (causal, fresh prompt, block size 16)")
    print("tokens | AMX    | AVX-512 | SDPA    | AVX-512 / AMX | GFLOP/s (AMX)")
    hq, hkv, d = args.heads[0], args.heads[1], args.head_dim
    gen = torch.Generator().manual_seed(0)
    for t in args.tokens:
        blocks = -(-t // 16)
        k_cache = torch.randn(hkv, blocks, 16, d, generator=gen).bfloat16()
        v_cache = torch.randn(hkv, blocks, 16, d, generator=gen).bfloat16()
        q = torch.randn(t, hq, d, generator=gen).bfloat16()
        table = torch.arange(blocks)

        def ours(allow: bool, k=k_cache, v=v_cache, q=q, table=table) -> None:
            kernels.prefill_attention(q, k, v, table, 0, d**-0.5, 0, allow_amx=allow)

        keys = k_cache.reshape(hkv, -1, d)[:, :t].repeat_interleave(hq // hkv, 0)
        values = v_cache.reshape(hkv, -1, d)[:, :t].repeat_interleave(hq // hkv, 0)
        queries = q.transpose(0, 1)

        def sdpa(q=queries, k=keys, v=values) -> None:
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

        runs: dict[str, list[float]] = {"amx": [], "avx": [], "sdpa": []}
        for fn in (lambda: ours(True), lambda: ours(False), sdpa):
            fn()
        for _ in range(args.reps):  # interleaved, so drift hits all three alike
            runs["amx"].append(timed_ms(lambda: ours(True)))
            runs["avx"].append(timed_ms(lambda: ours(False)))
            runs["sdpa"].append(timed_ms(sdpa))
        med = {k: statistics.median(v) for k, v in runs.items()}
        flops = 2 * 2 * hq * d * t * (t + 1) / 2
        print(
            f"{t:6d} | {med['amx']:6.2f} | {med['avx']:7.2f} | {med['sdpa']:7.2f} | "
            f"{med['avx'] / med['amx']:12.2f}x | {flops / med['amx'] / 1e6:8.0f}"
        )


if __name__ == "__main__":
    main()
