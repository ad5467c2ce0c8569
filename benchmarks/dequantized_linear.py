"""Quantized weight-only linears at batches of a few dozen rows, per call: the ways the
bf16 engine can run them, with bf16 beside them. Qwen3-0.6B's four linear shapes,
a layer's total in ms, weights cycled past the caches (`--copies`), one process.

    python benchmarks/dequantized_linear.py --rows 8 16 32 64 [--scheme int4 | int8 | fp8 | fp8-blocks]

  quant_linear   groups scaled in registers (the kernel up to kernel_limits.max_kernel_rows)
  dequantized    dequantized_linear: blocks of rows dequantized into a scratch
  dequant+gemm   dequantize_bf16 into a full copy, then oneDNN's bf16 GEMM
  amx            amx_weight_only_linear: the rows decoded into AMX-BF16 tiles (CPUs with AMX;
                 int8 and fp8 per channel, int4 groups of a multiple of 128)
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
WAYS = ("quant_linear", "dequantized", "dequant+gemm", "amx", "bf16 gemv", "bf16 onednn")
SCHEMES = {"int4": "int4_w4a16", "int8": "int8_w8a16", "fp8": "fp8_w8a16"}


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

    q0 = qs[0]
    # dequantized_linear takes int4 and block-scaled fp8 only; the AMX kernel needs AMX-BF16
    has_dequantized = q0.scheme == "int4_w4a16" or q0.group_size > 0
    has_amx = k.amx_bf16_available() and k.amx_weight_only_supports(
        q0.kind, q0.in_features, q0.group_size
    )
    return {
        "quant_linear": lambda i: k.quant_linear(x, *operands(i), None, qs[i].group_size, None),
        **(
            {"dequantized": lambda i: k.dequantized_linear(x, *operands(i), qs[i].group_size, None)}
            if has_dequantized
            else {}
        ),
        "dequant+gemm": deq_gemm,
        **(
            {"amx": lambda i: k.amx_weight_only_linear(x, *operands(i), qs[i].group_size, None)}
            if has_amx
            else {}
        ),
        "bf16 gemv": lambda i: k.gemv_bf16(x, dense[i], None),
        "bf16 onednn": lambda i: torch.ops.mkldnn._linear_pointwise(
            x, packed[i], None, "none", [], ""
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--scheme", choices=[*SCHEMES, "fp8-blocks"], default="int4")
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--copies", type=int, default=8, help="weights cycled (past the caches)")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    k = get_cpu_kernels()
    if k is None:
        raise SystemExit("needs the AVX512-BF16 kernels")
    print(f"{cpu_model()} ({isa_summary()}), {torch.get_num_threads()} threads, {args.scheme}")
    torch.manual_seed(0)
    total = {(rows, way): float("nan") for rows in args.rows for way in WAYS}
    for n, kk in tqdm(SHAPES.values(), desc="shapes"):
        ws = [torch.randn(n, kk) * 0.02 for _ in range(args.copies)]
        if args.scheme in SCHEMES:
            group = args.group if args.scheme == "int4" else 0
            qs = [formats.quantize(w, SCHEMES[args.scheme], group_size=group) for w in ws]
        else:
            qs = [block_fp8(w, args.group) for w in ws]
        dense = [w.bfloat16() for w in ws]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 128) for w in dense]
        del ws
        for rows in args.rows:
            x = torch.randn(rows, kk).bfloat16()

            calls = ways(k, qs, dense, packed, x)
            for way, fn in calls.items():
                so_far = total[(rows, way)]
                so_far = 0.0 if so_far != so_far else so_far  # NaN: a way this scheme lacks
                total[(rows, way)] = so_far + per_call_ms(fn, args.copies, args.reps)
    print("| rows | " + " | ".join(WAYS) + " | fastest quantized vs bf16 onednn |")
    print("|---" * (len(WAYS) + 2) + "|")
    for rows in args.rows:
        cells = " | ".join(f"{total[(rows, way)]:.2f}" for way in WAYS).replace("nan", "-")
        quantized = [total[(rows, w)] for w in WAYS[:4] if total[(rows, w)] == total[(rows, w)]]
        ratio = total[(rows, "bf16 onednn")] / min(quantized)
        print(f"| {rows} | {cells} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
