"""Per-call time of the AVX2 family's small fp32 ops against the plain-PyTorch paths they
replace (RMSNorm, RMSNorm with the residual add, a per-head RMSNorm, SiLU-and-mul), at the
0.6B shape's sizes, 1 and 32 rows; and one layer's paged decode attention (16 query heads,
8 KV heads of 128, one request) at contexts 192, 1024 and 4096 against the plain-PyTorch
backend, the caches cycled through so they stream from memory, for each KV-cache dtype
the kernel reads (fp32, bf16, fp8 e4m3).

    python benchmarks/avx2_ops.py [--attention-only]      # on any AVX2 CPU
"""

from __future__ import annotations

import time

import torch

from minivllm.kernels import get_avx2_kernels
from minivllm.kernels.isa import cpu_model, isa_summary
from minivllm.layers.activation import SiluAndMul
from minivllm.layers.layernorm import RMSNorm


def per_call_us(fn, reps: int = 2000) -> float:
    for _ in range(50):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e6


def main() -> None:
    import sys

    torch.set_num_threads(2)
    ops = get_avx2_kernels()
    if ops is None:
        raise SystemExit("no AVX2 kernels on this machine")
    print(f"{cpu_model()} [{isa_summary()}], 2 threads; microseconds per call")
    if "--attention-only" not in sys.argv:
        for rows in (1, 32):
            measure(ops, rows)
    for context in (192, 1024, 4096):
        attention(ops, context)


def measure(ops, rows: int) -> None:
    x, residual = torch.randn(rows, 1024), torch.randn(rows, 1024)
    heads, gate_up = torch.randn(rows * 16, 128), torch.randn(rows, 6144)
    norm, head_norm, act = RMSNorm(1024), RMSNorm(128), SiluAndMul()  # plain paths
    cases = {
        "rms_norm": (lambda: norm(x), lambda: ops.rms_norm(x, norm.weight, 1e-6)),
        "add + rms_norm": (
            lambda: norm(x, residual),
            lambda: ops.fused_add_rms_norm(x, residual, norm.weight, 1e-6),
        ),
        "per-head rms_norm": (
            lambda: head_norm(heads),
            lambda: ops.rms_norm(heads, head_norm.weight, 1e-6),
        ),
        "silu_and_mul": (lambda: act(gate_up), lambda: ops.silu_and_mul(gate_up)),
    }
    for name, (plain, kernel) in cases.items():
        a, b = per_call_us(plain), per_call_us(kernel)
        print(f"{rows:>3} rows {name:>18}: plain {a:7.1f}  avx2 {b:7.1f}  ({a / b:.1f}x)")


def attention(ops, context: int, heads: int = 16, kv_heads: int = 8, dim: int = 128) -> None:
    from types import SimpleNamespace

    from minivllm.layers.attention.torch_backend import TorchAttentionBackend, to_cache_dtype

    block, copies = 16, max(2, 96 // (context // 128))  # ~100 MB of fp32 caches or more
    blocks = context // block
    caches = [torch.randn(2, kv_heads, blocks, block, dim) for _ in range(copies)]
    q = torch.randn(1, heads, dim)
    tables, lens = torch.arange(blocks).view(1, blocks), torch.tensor([context])
    layer = SimpleNamespace(
        num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, scale=dim**-0.5, sliding_window=None
    )
    meta = SimpleNamespace(
        decode_token_indices=torch.arange(1), decode_block_tables=tables, decode_seq_lens=lens
    )
    backend, out = TorchAttentionBackend(1), torch.empty(1, heads, dim)
    turn = iter(range(10**9))

    def plain():
        backend.decode(layer, q, caches[next(turn) % copies], meta, out)

    reps = max(20, 4000 // (context // 64))
    a = per_call_us(plain, reps)
    print(f"decode attention, context {context:>4}: plain {a:7.1f} us; avx2 by KV-cache dtype:")
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        stored = [to_cache_dtype(c, dtype) for c in caches]

        def kernel(stored=stored):
            c = stored[next(turn) % copies]
            ops.paged_attention_decode(q, c[0], c[1], tables, lens, layer.scale, 0)

        b = per_call_us(kernel, reps)
        rate = 2 * kv_heads * context * dim * dtype.itemsize / b / 1e3  # GB/s of K and V
        print(f"  {str(dtype)[6:]:>14} {b:7.1f} us ({a / b:.1f}x plain; {rate:.1f} GB/s of KV)")


if __name__ == "__main__":
    main()
