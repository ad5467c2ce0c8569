"""int4 and block-scaled fp8 linears at batches of a few dozen rows, per call: the three
ways the bf16 engine can run them, with bf16 beside them. Qwen3-0.6B's four linear shapes,
a layer's total in ms, weights cycled past the caches (`--copies`), one process.

    python benchmarks/dequantized_linear.py --rows 8 16 32 64

  quant_linear   groups scaled in registers (the kernel up to kernel_limits.max_kernel_rows)
  dequantized    dequantized_linear: blocks of rows dequantized into a scratch
  dequant+gemm   dequantize_bf16 into a full copy, then oneDNN's bf16 GEMM
  bf16 gemv      the same shapes unquantized, on our GEMV (the engine's kernel to 16 rows)
  bf16 onednn    ... and on oneDNN's prepacked weights (past 16 rows)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from tqdm import tqdm

from minivllm.kernels import get_cpu_kernels
from minivllm.kernels.isa import cpu_model, isa_summary
from minivllm.quantization import formats

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from block_fp8 import block_fp8  # noqa: E402

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
WAYS = ("quant_linear", "dequantized", "dequant+gemm", "bf16 gemv", "bf16 onednn")


def per_call_ms(fn: Callable[[int], torch.Tensor], copies: int, reps: int) -> float:
    for i in range(copies):
        fn(i)
    start = time.perf_counter()
    for _ in range(reps):
        for i in range(copies):
            fn(i)
    return (time.perf_counter() - start) / (reps * copies) * 1e3


def ways(
    k: ModuleType,
    qs: list[formats.QuantWeights],
    dense: list[torch.Tensor],
    packed: list[torch.Tensor],
    x: torch.Tensor,
) -> dict[str, Callable[[int], torch.Tensor]]:
    """Each way's call on copy i of a linear, by name (WAYS)."""

    def deq_gemm(i: int) -> torch.Tensor:
        q = qs[i]
        out = torch.empty(q.out_features, q.in_features, dtype=torch.bfloat16)
        k.dequantize_bf16(q.kind, q.weight, q.scale, q.zero, q.group_size, out)
        return F.linear(x, out)

    def operands(i: int) -> tuple:
        q = qs[i]
        return q.kind, q.weight, q.scale, q.zero

    return {
        "quant_linear": lambda i: k.quant_linear(x, *operands(i), None, qs[i].group_size, None),
        "dequantized": lambda i: k.dequantized_linear(x, *operands(i), qs[i].group_size, None),
        "dequant+gemm": deq_gemm,
        "bf16 gemv": lambda i: k.gemv_bf16(x, dense[i], None),
        "bf16 onednn": lambda i: torch.ops.mkldnn._linear_pointwise(
            x, packed[i], None, "none", [], ""
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--scheme", choices=["int4", "fp8-blocks"], default="int4")
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--copies", type=int, default=8, help="weights cycled (past the caches)")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    k = get_cpu_kernels()
    if k is None:
        raise SystemExit("needs the AVX512-BF16 kernels")
    print(f"{cpu_model()} ({isa_summary()}), {torch.get_num_threads()} threads, {args.scheme}")
    torch.manual_seed(0)
    total = {(rows, way): 0.0 for rows in args.rows for way in WAYS}
    for n, kk in tqdm(SHAPES.values(), desc="shapes"):
        ws = [torch.randn(n, kk) * 0.02 for _ in range(args.copies)]
        if args.scheme == "int4":
            qs = [formats.quantize(w, "int4_w4a16", group_size=args.group) for w in ws]
        else:
            qs = [block_fp8(w, args.group) for w in ws]
        dense = [w.bfloat16() for w in ws]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 128) for w in dense]
        del ws
        for rows in args.rows:
            x = torch.randn(rows, kk).bfloat16()

            calls = ways(k, qs, dense, packed, x)
            for way, fn in calls.items():
                total[(rows, way)] += per_call_ms(fn, args.copies, args.reps)
    print("| rows | " + " | ".join(WAYS) + " | dequantized vs dequant+gemm |")
    print("|---" * (len(WAYS) + 2) + "|")
    for rows in args.rows:
        cells = " | ".join(f"{total[(rows, way)]:.2f}" for way in WAYS)
        ratio = total[(rows, "dequant+gemm")] / total[(rows, "dequantized")]
        print(f"| {rows} | {cells} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
