"""Where bf16 linears should leave our GEMV for oneDNN: per call, at several batch sizes.

    python benchmarks/bf16_linear_rows.py [--rows 1 4 8 16 32 64] [--copies 28]

For the Qwen3-0.6B shape's four linears and its LM head, the median ms per call of our
AVX512-BF16 GEMV (`gemv_bf16`), oneDNN on a prepacked copy (what `layers/cpu_linear.py`
keeps where it fits) and plain `F.linear` (oneDNN laying the weight out at each call),
with the weights cycled through `--copies` copies so that they come from memory, as in a
decode step. `cpu_linear.kernel_row_limits()` holds the limits these figures chose (on
CPUs with AMX-BF16 oneDNN's GEMM runs on the tile unit and overtakes the GEMV sooner);
the last column says which the engine takes at each size.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm import tqdm

from minivllm.kernels import get_cpu_kernels
from minivllm.kernels.isa import cpu_flags, cpu_model, isa_summary
from minivllm.layers.cpu_linear import kernel_row_limits

SHAPES = {
    "qkv": (4096, 1024),
    "o": (1024, 2048),
    "gate_up": (6144, 1024),
    "down": (1024, 3072),
    "lm_head": (151936, 1024),
}


def _time(op, x: torch.Tensor, weights: list[torch.Tensor], reps: int) -> float:
    """Median ms of `op(x, w)` over the weights, each call on the next copy."""
    op(x, weights[0])
    runs = []
    for _ in range(reps):
        start = time.perf_counter()
        for w in weights:
            op(x, w)
        runs.append((time.perf_counter() - start) / len(weights))
    return statistics.median(runs) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--copies", type=int, default=28, help="weights cycled (the head: 2)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    kernels = get_cpu_kernels()
    if kernels is None:
        raise SystemExit("this CPU has no AVX512-BF16: the GEMV kernel does not run here")
    torch.set_num_threads(args.threads)
    plain_limit, packed_limit = kernel_row_limits()
    amx = "amx_bf16" in cpu_flags()
    print(f"{cpu_model()} [{isa_summary()}] (AMX-BF16: {amx}), {args.threads} threads; ms per call")
    print(f"our GEMV up to {packed_limit} rows on prepacked weights, {plain_limit} on plain")
    print("rows | linear  |   GEMV | oneDNN packed | F.linear | engine takes")
    for name, (n, k) in tqdm(SHAPES.items(), desc="weights", leave=False):
        copies = 2 if name == "lm_head" else args.copies
        weights = [torch.randn(n, k).bfloat16() for _ in range(copies)]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 128) for w in weights]
        gemv_op = lambda x, w: kernels.gemv_bf16(x, w, None)  # noqa: E731
        packed_op = lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")  # noqa: E731
        for rows in args.rows:
            x = torch.randn(rows, k).bfloat16()
            gemv = _time(gemv_op, x, weights, args.reps)
            onednn = _time(packed_op, x, packed, args.reps)
            plain = _time(torch.nn.functional.linear, x, weights, args.reps)
            takes = "GEMV" if rows <= packed_limit else "oneDNN"
            print(
                f"{rows:4d} | {name:7s} | {gemv:6.3f} | {onednn:13.3f} | {plain:8.3f} | {takes}",
                flush=True,
            )


if __name__ == "__main__":
    main()
