"""int8_w8a8 linears per call: our AMX kernel against bf16 (oneDNN on its prepacked weight,
what a bf16 engine runs past a few rows), oneDNN's int8 GEMM with the per-token scaling
after it (the path before the AMX kernel), and the VNNI kernel (decode rows), over the
Qwen3-0.6B shape's four linears. Where each path is fastest sets
formats.W8A8_AMX_MAX_KERNEL_ROWS.

    python benchmarks/amx_w8a8.py                 # rows 4 8 16 64 512
    python benchmarks/amx_w8a8.py --rows 6 2048
"""

from __future__ import annotations

import argparse
import time

import torch

from minivllm.kernels import get_cpu_kernels
from minivllm.kernels.isa import cpu_model, isa_summary
from minivllm.quantization import formats

SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]  # qkv, o, gate_up, down


def median_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 8, 16, 64, 512])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = get_cpu_kernels()
    if ops is None or not ops.amx_w8a8_available():
        raise SystemExit("this machine has no AMX-INT8 (or no AVX512-BF16 kernels)")
    print(f"{cpu_model()} [{isa_summary()}], {args.threads} threads; median ms per call")
    print("rows  N x K       | bf16 oneDNN | int8 oneDNN | VNNI   | AMX    | AMX vs bf16")
    torch.manual_seed(0)
    for rows in args.rows:
        for n, k in SHAPES:
            times = measure(ops, rows, n, k, args.reps)
            cells = " | ".join(f"{t:{w}.3f}" for t, w in zip(times, (11, 11, 6, 6)))
            print(f"{rows:<5} {n:>4} x {k:<5} | {cells} | {times[0] / times[3]:.2f}x")


def measure(ops, rows: int, n: int, k: int, reps: int) -> tuple[float, ...]:
    """Median ms of bf16 oneDNN, int8 oneDNN, the VNNI kernel and the AMX kernel."""
    w = torch.randn(n, k).bfloat16() * 0.02
    x = torch.randn(rows, k).bfloat16()
    bf16_packed = torch.ops.mkldnn._reorder_linear_weight(w, formats.PACK_BATCH_HINT)
    qw = formats.quantize(w, "int8_w8a8")
    onednn = formats.quantize(w, "int8_w8a8")
    formats.prepack_w8a8(onednn)
    amx = formats.pack_amx_w8a8(qw.weight)
    return (
        median_ms(
            lambda: torch.ops.mkldnn._linear_pointwise(x, bf16_packed, None, "none", [], ""), reps
        ),
        median_ms(
            lambda: formats.w8a8_large_batch(x, onednn, None, ops.quantize_per_token_int8), reps
        ),
        median_ms(
            lambda: ops.quant_linear(x, qw.kind, qw.weight, qw.scale, None, qw.wsum, 0, None), reps
        ),
        median_ms(lambda: ops.amx_w8a8_linear(x, amx, k, qw.scale, None), reps),
    )


if __name__ == "__main__":
    main()
