"""Per-call time of DeepSeek's router (float32 projection + group-limited top-k) with the
choice in PyTorch ops (`layers/moe.grouped_topk`) against the compiled op
(`kernels/moe_routing.cpp`), in one process, at the 400M benchmark model's shape and at
DeepSeek-V3's (256 experts in 8 groups, top-8 from 4 groups, hidden 7168).

    python benchmarks/moe_routing.py
    python benchmarks/moe_routing.py --tokens 1 64
"""

from __future__ import annotations

import argparse
import time

import torch

from minivllm.kernels.isa import cpu_model, isa_summary
from minivllm.kernels.registry import select_kernels
from minivllm.layers.moe import GroupedTopKRouter

# (experts, groups, groups allowed, top-k, hidden)
SHAPES = {"400M": (32, 4, 2, 4, 1024), "DeepSeek-V3": (256, 8, 4, 8, 7168)}


def per_call_us(router: GroupedTopKRouter, x: torch.Tensor, calls: int) -> float:
    for _ in range(max(calls // 10, 3)):
        router(x)
    start = time.perf_counter()
    for _ in range(calls):
        router(x)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 512])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    op = select_kernels("cpu", torch.float32).op("moe_grouped_topk")
    if op is None:
        raise SystemExit("no compiled CPU kernels here (needs AVX2 + FMA and a C++ compiler)")
    print(f"CPU: {cpu_model()} ({isa_summary()}), {torch.get_num_threads()} threads")
    print("| shape | tokens | PyTorch ops (us) | compiled (us) | ratio |")
    print("|---|---|---|---|---|")
    for name, (experts, groups, allowed, top_k, hidden) in SHAPES.items():
        router = GroupedTopKRouter(hidden, experts, top_k, groups, allowed, True, 2.5)
        torch.nn.init.normal_(router.weight, std=0.02)
        for tokens in args.tokens:
            x = torch.randn(tokens, hidden)
            calls = max(2000 // tokens, 20)
            router.topk_op = None
            plain = per_call_us(router, x, calls)
            router.topk_op = op
            compiled = per_call_us(router, x, calls)
            print(f"| {name} | {tokens} | {plain:.1f} | {compiled:.1f} | {plain / compiled:.2f}x |")


if __name__ == "__main__":
    main()
