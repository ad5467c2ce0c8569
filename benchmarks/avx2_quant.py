"""Per-call time of the quantized linears in fp32 engines on AVX2 (`kernels/avx2_quant.cpp`)
against the bf16 weight panels an unquantized fp32 engine runs, over the Qwen3-0.6B
shape's linears (qkv, o, gate_up, down: the whole of one layer) and its LM head, with the
weights streamed from memory (each rep cycles through enough copies to overflow the
caches). Prints milliseconds per layer and, at one row, the weight bytes' rate. On
AVX-512 CPUs with VNNI, int8 and int4 run twice: as the engine does (`avx512_quantw.cpp`'s
form up to 8 rows) and with that form switched off ("avx2": the AVX2 form it replaces).

    python benchmarks/avx2_quant.py                 # on any AVX2 CPU
    python benchmarks/avx2_quant.py --rows 1 8 32   # other row counts
"""

from __future__ import annotations

import argparse
import time

import torch

from minivllm.kernels import get_avx2_kernels
from minivllm.kernels.isa import AVX512_VNNI_FLAGS, cpu_flags, cpu_model, isa_summary
from minivllm.layers.panel_linear import pack_panels
from minivllm.quantization import formats

LAYER = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]  # (N, K) of one 0.6B layer
LM_HEAD = [(151936, 1024)]
COPIES = 12  # layers' worth of weights cycled through: ~190 MB as bf16, past any cache


def variants(ops, shapes, gen, copies):
    """{name: (per-copy callables taking x, bytes per copy)} for one group of shapes."""
    out = {}
    weights = [
        [torch.randn(n, k, generator=gen) / k**0.5 for n, k in shapes] for _ in range(copies)
    ]
    panels = [[pack_panels(w) for w in copy] for copy in weights]
    out["bf16 panels"] = (
        [
            [
                lambda x, p=p, n=w.shape[0]: ops.linear_bf16w(x[p.shape[1]], p, n, None)
                for p, w in zip(pc, wc)
            ]
            for pc, wc in zip(panels, weights)
        ],
        sum(p.numel() * 2 for p in panels[0]),
    )
    schemes = [
        ("int8", "int8_w8a16", None),
        ("int4 g128", "int4_w4a16", None),
        ("fp8", "fp8_w8a16", None),
        ("int4 g128 w4a8", "int4_w4a8", None),
    ]
    if AVX512_VNNI_FLAGS <= cpu_flags():  # the AVX-512 form beside the AVX2 one it replaces
        schemes[2:2] = [("int8 avx2", "int8_w8a16", False), ("int4 avx2", "int4_w4a16", False)]
    for label, scheme, avx512 in schemes:
        qws = [[formats.quantize(w, scheme) for w in copy] for copy in weights]
        out[label] = (
            [
                [
                    lambda x, q=q, avx512=avx512: _quantw(ops, q, x[q.in_features], avx512)
                    for q in copy
                ]
                for copy in qws
            ],
            sum(q.weight.numel() + q.scale.numel() * 4 for q in qws[0]),
        )
    return out


def _quantw(ops, q, x, avx512: bool | None):
    """linear_quantw on q, with the AVX-512 form switched as `avx512` says (None: as is)."""
    before = None if avx512 is None else ops.set_quantw_avx512(avx512)
    try:
        return ops.linear_quantw(x, q.kind, q.weight, q.scale, q.zero, q.group_size, None)
    finally:
        if before is not None:
            ops.set_quantw_avx512(before)


def per_call_ms(calls, x, reps: int) -> float:
    for copy in calls[:2]:
        for f in copy:
            f(x)
    start = time.perf_counter()
    for i in range(reps):
        for f in calls[i % len(calls)]:
            f(x)
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64, 256])
    parser.add_argument("--reps", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = get_avx2_kernels()
    if ops is None:
        raise SystemExit("no AVX2 kernels on this machine")
    print(f"{cpu_model()} [{isa_summary()}], {args.threads} threads; ms per call (GB/s of weights)")
    gen = torch.Generator().manual_seed(0)
    # the LM head alone is 311 MB as bf16 panels: one copy streams from memory
    for title, shapes, copies in [("one layer", LAYER, COPIES), ("LM head", LM_HEAD, 1)]:
        found = variants(ops, shapes, gen, copies)
        print(f"-- {title}: " + ", ".join(f"{n}x{k}" for n, k in shapes))
        for rows in args.rows:
            x = {k: torch.randn(rows, k) for _, k in shapes}  # by input size
            base = None
            cells = []
            for name, (calls, nbytes) in found.items():
                ms = per_call_ms(calls, x, args.reps if copies > 1 else 4)
                base = base or ms
                cells.append(f"{name} {ms:7.2f} ({nbytes / ms / 1e6:5.1f}, {base / ms:.2f}x)")
            print(f"{rows:>4} rows  " + "  ".join(cells))


if __name__ == "__main__":
    main()
