"""int8_w8a8 linears per call against bf16, over the Qwen3-0.6B shape's four linears.

Columns: bf16 (oneDNN on its prepacked weight, what a bf16 engine runs past a few rows);
the VNNI kernel (decode rows, quant_w8a8.cpp); our VNNI GEMM on its packed panels (CPUs
without AMX); our AMX kernel (where the CPU has AMX-INT8). Where each path is fastest sets
kernel_limits.W8A8_AMX_MAX_KERNEL_ROWS and W8A8_VNNI_MAX_KERNEL_ROWS. (oneDNN's own int8 GEMM,
once a column here, lost to both of ours and left the engine.)

`--fp32`: an fp32 engine's paths (the AVX2 family, CPUs without AVX512-BF16): bf16 weight
panels (linear_bf16w, what the unquantized model runs; from 128 rows on Intel the widened
weight through MKL), int8_w8a8 on AVX2 (quantized activations' integers through
linear_quantw's fp32 FMAs, the path of CPUs without VNNI) and the AVX2 family's VNNI GEMM
(avx2_vnni.cpp, AVX-512 CPUs with VNNI: Ice Lake, Cascade Lake).

    python benchmarks/w8a8_linear.py                 # rows 4 8 16 64 512
    python benchmarks/w8a8_linear.py --rows 6 2048
    python benchmarks/w8a8_linear.py --fp32 --rows 1 4 16 64 512
"""

from __future__ import annotations

import argparse
import time

import torch

from minivllm.kernels import get_avx2_kernels, get_cpu_kernels
from minivllm.kernels.isa import AVX512_VNNI_FLAGS, cpu_flags, cpu_model, isa_summary
from minivllm.layers.cpu_linear import PACK_BATCH_HINT
from minivllm.layers.panel_linear import pack_panels
from minivllm.quantization import formats, kernel_limits, packing

SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]  # qkv, o, gate_up, down
COLUMNS = ("bf16 oneDNN", "VNNI rows", "VNNI GEMM", "AMX")
FP32_COLUMNS = ("bf16 panels", "AVX2 w8a8", "VNNI GEMM fp32")


def median_ms(fn, reps: int, calls: int) -> float:
    """Median ms per call of `fn`, which makes `calls` calls."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) / calls)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 8, 16, 64, 512])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--fp32", action="store_true", help="an fp32 engine's paths (the AVX2 kernel family)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.fp32:
        return main_fp32(args)
    ops = get_cpu_kernels()
    if ops is None or not kernel_limits.kernel_supports("int8_w8a8"):
        raise SystemExit("this machine has no AVX512-VNNI (or no AVX512-BF16 kernels)")
    amx = ops.amx_w8a8_available()
    shown = [c for c in COLUMNS if amx or c != "AMX"]
    print_table(args, shown, "best int8 vs bf16", lambda *shape: measure(ops, *shape, amx))


def print_table(args: argparse.Namespace, shown: list[str], ratio: str, measure_one) -> None:
    """One line per rows and shape: `measure_one(rows, n, k, reps)`'s ms per column, and
    the first column's time over the fastest of the others."""
    print(f"{cpu_model()} [{isa_summary()}], {args.threads} threads; median ms per call")
    print("rows  N x K       | " + " | ".join(shown) + f" | {ratio}")
    torch.manual_seed(0)
    for rows in args.rows:
        for n, k in SHAPES:
            times = measure_one(rows, n, k, args.reps)
            cells = " | ".join(f"{t:{len(c)}.3f}" for t, c in zip(times, shown))
            print(f"{rows:<5} {n:>4} x {k:<5} | {cells} | {times[0] / min(times[1:]):.2f}x")


def main_fp32(args: argparse.Namespace) -> None:
    ops = get_avx2_kernels()
    if ops is None:
        raise SystemExit("this machine has no AVX2 + FMA (the AVX2 kernel family)")
    vnni = AVX512_VNNI_FLAGS <= cpu_flags()
    shown = [c for c in FP32_COLUMNS if vnni or c != "VNNI GEMM fp32"]
    print_table(
        args, shown, "best w8a8 vs bf16 panels", lambda *shape: measure_fp32(ops, *shape, vnni)
    )


def measure_fp32(ops, rows: int, n: int, k: int, reps: int, vnni: bool) -> list[float]:
    """`measure` for an fp32 engine's paths (`--fp32`), weights streamed from memory too."""
    copies = max(2, (64 << 20) // (n * k))
    x = torch.randn(rows, k)
    unit = torch.ones(n)
    layers = []
    for _ in range(copies):
        w = (torch.randn(n, k) * 0.02).bfloat16().float()
        qw = formats.quantize(w, "int8_w8a8")
        vnni_packed = packing.pack_vnni_w8a8(qw.weight) if vnni else None
        layers.append((qw, pack_panels(w), vnni_packed))

    def avx2_w8a8(qw: formats.QuantWeights) -> torch.Tensor:  # QuantizedLinearMethod._apply_fp32
        xq, xs = formats.quantize_per_token(x)
        acc = ops.linear_quantw(xq.float(), formats.KIND_INT8_W8A16, qw.weight, unit, None, 0, None)
        return acc.mul_(xs[:, None]).mul_(qw.scale)

    paths = [
        lambda: [ops.linear_bf16w(x, panels, n, None) for _, panels, _ in layers],
        lambda: [avx2_w8a8(qw) for qw, _, _ in layers],
    ]
    if vnni:
        paths.append(
            lambda: [ops.vnni_w8a8_linear(x, v, k, q.scale, q.wsum, None) for q, _, v in layers]
        )
    return [median_ms(path, reps, copies) for path in paths]


def measure(ops, rows: int, n: int, k: int, reps: int, amx: bool) -> list[float]:
    """Median ms of each column's path for one [rows, k] x [n, k]^T call. Each path cycles
    through copies of the weight that together outgrow the last-level cache (64 MiB of
    int8), so the weights stream from memory as in a model's forward pass."""
    copies = max(2, (64 << 20) // (n * k))
    x = torch.randn(rows, k).bfloat16()
    layers = []
    for _ in range(copies):
        w = torch.randn(n, k).bfloat16() * 0.02
        qw = formats.quantize(w, "int8_w8a8")
        bf16_packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)
        amx_packed = packing.pack_amx_w8a8(qw.weight) if amx else None
        layers.append((qw, bf16_packed, packing.pack_vnni_w8a8(qw.weight), amx_packed))
    paths = [
        lambda: [
            torch.ops.mkldnn._linear_pointwise(x, bp, None, "none", [], "")
            for _, bp, _, _ in layers
        ],
        lambda: [
            ops.quant_linear(x, q.kind, q.weight, q.scale, None, q.wsum, 0, None)
            for q, *_ in layers
        ],
        lambda: [ops.vnni_w8a8_linear(x, v, k, q.scale, q.wsum, None) for q, _, v, _ in layers],
    ]
    if amx:
        paths.append(lambda: [ops.amx_w8a8_linear(x, a, k, q.scale, None) for q, *_, a in layers])
    return [median_ms(path, reps, copies) for path in paths]


if __name__ == "__main__":
    main()
