"""Block-scaled fp8 linears per call in a bf16 engine: the bf16 kernel (`quant_linear`'s
grouped fp8, kernels/quant_gemm.cpp) against what bf16 engines ran before it, the AVX2
family's fp32 op on rows converted to fp32 and back, and against per-channel fp8 on the
same kernel. Qwen3-0.6B's four linear shapes, 128-k blocks, weights streamed from memory
(`--copies` of each cycled), one process.

    python benchmarks/block_fp8.py --rows 1 4 16
"""

from __future__ import annotations

import argparse
import time

import torch

from minivllm.kernels import get_avx2_kernels, get_cpu_kernels
from minivllm.kernels.isa import cpu_model, isa_summary
from minivllm.quantization import formats

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}


def per_call_us(fn, copies: int, reps: int) -> float:
    for i in range(2):
        fn(i)
    start = time.perf_counter()
    for _ in range(reps):
        for i in range(copies):
            fn(i)
    return (time.perf_counter() - start) / (reps * copies) * 1e6


def block_fp8(w: torch.Tensor, group: int) -> formats.QuantWeights:
    scale = w.unflatten(-1, (-1, group)).abs().amax(-1) / formats.FP8_MAX
    q = (w / scale.repeat_interleave(group, -1)).to(torch.float8_e4m3fn)
    return formats.from_fp8_values(q, scale, group)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--copies", type=int, default=16, help="weights cycled (past the caches)")
    parser.add_argument("--reps", type=int, default=4)
    args = parser.parse_args()
    bf16, avx2 = get_cpu_kernels(), get_avx2_kernels()
    if bf16 is None or avx2 is None:
        raise SystemExit("needs the AVX512-BF16 kernels (and the AVX2 family beside them)")
    print(f"{cpu_model()} ({isa_summary()}), {torch.get_num_threads()} threads")
    print(
        "| rows | linear | bf16 kernel, blocks (us) | AVX2 op, fp32 rows (us) | per-channel fp8 (us) | speed-up |"
    )
    print("|---|---|---|---|---|---|")
    torch.manual_seed(0)
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k) * 0.02 for _ in range(args.copies)]
        blocks = [block_fp8(w, args.group) for w in ws]
        channels = [formats.quantize(w, "fp8_w8a16") for w in ws]
        del ws
        for rows in args.rows:
            x = torch.randn(rows, k).bfloat16()

            def kernel(i, qws, x=x):
                q = qws[i]
                return bf16.quant_linear(
                    x, q.kind, q.weight, q.scale, None, None, q.group_size, None
                )

            def borrowed(i, x=x, qws=blocks):
                q = qws[i]
                y = avx2.linear_quantw(
                    x.float(), q.kind, q.weight, q.scale, None, q.group_size, None
                )
                return y.bfloat16()

            t_kernel = per_call_us(lambda i, q=blocks: kernel(i, q), args.copies, args.reps)
            t_avx2 = per_call_us(borrowed, args.copies, args.reps)
            t_channel = per_call_us(lambda i, q=channels: kernel(i, q), args.copies, args.reps)
            print(
                f"| {rows} | {name} {n}x{k} | {t_kernel:.0f} | {t_avx2:.0f} | {t_channel:.0f} "
                f"| {t_avx2 / t_kernel:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
