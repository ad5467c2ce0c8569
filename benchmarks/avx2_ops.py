"""Per-call time of the AVX2 family's small fp32 ops against the plain-PyTorch paths they
replace (RMSNorm, RMSNorm with the residual add, a per-head RMSNorm, SiLU-and-mul), at the
0.6B shape's sizes, 1 and 32 rows.

    python benchmarks/avx2_ops.py            # on any AVX2 CPU
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
    torch.set_num_threads(2)
    ops = get_avx2_kernels()
    if ops is None:
        raise SystemExit("no AVX2 kernels on this machine")
    print(f"{cpu_model()} [{isa_summary()}], 2 threads; microseconds per call")
    for rows in (1, 32):
        measure(ops, rows)


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


if __name__ == "__main__":
    main()
