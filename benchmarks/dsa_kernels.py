"""The DSA and MoE CPU kernels against their plain-PyTorch references, at decode sizes.

    python benchmarks/dsa_kernels.py [--reps 5] [--threads N]

- indexer: dsa_indexer_topk vs dsa.indexer_topk, 64 index heads x 128, top-2048;
- decode: sparse_mla_decode vs dsa.sparse_mla_decode, 16 heads (a TP shard) over
  2048 selected latent rows of 512 + 64;
- moe: moe_experts vs moe.moe_reference, 64 experts, top-6, hidden 1024, intermediate 256.

Each request has its own cache rows (contexts x batch rows in all) and the MoE calls
cycle through random expert choices, so the weights and rows mostly come from memory, as
in a model's forward pass. Times are the best of --reps calls in milliseconds (the best,
not the median: on a shared machine the median measures the other load); ratio = torch /
kernel.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from minivllm.kernels.isa import cpu_model, isa_summary
from minivllm.kernels.registry import select_kernels
from minivllm.layers.attention.dsa import indexer_topk, sparse_mla_decode
from minivllm.layers.moe import moe_reference

BATCHES = (1, 16)
CONTEXTS = (1024, 8192, 32768)
TOPK = 2048


def best_ms(fn: Callable[[int], object], reps: int, budget_s: float = 3.0) -> float:
    """The fastest of up to `reps` calls (fewer once `budget_s` is spent), after a warm-up."""
    fn(0)
    times: list[float] = []
    spent = 0.0
    for i in range(reps):
        start = time.perf_counter()
        fn(i + 1)
        times.append(time.perf_counter() - start)
        spent += times[-1]
        if spent > budget_s:
            break
    return 1e3 * min(times)


def rows_per_request(batch: int, context: int) -> torch.Tensor:
    """Each request's token -> cache row table: its own rows, scattered over the cache."""
    return torch.randperm(batch * context).view(batch, context)


def bench_indexer(op: Callable, batch: int, context: int, reps: int) -> tuple[float, float]:
    heads, dim = 64, 128
    keys = torch.randn(batch * context, dim).bfloat16()
    key_rows = rows_per_request(batch, context)
    index_q = torch.randn(batch, heads, dim).bfloat16()
    index_w = torch.randn(batch, heads) * heads**-0.5
    row_req, positions = torch.arange(batch), torch.full((batch,), context - 1)
    args = (index_q, index_w, key_rows, row_req, positions, keys, None, TOPK, dim**-0.5)
    return best_ms(lambda _: indexer_topk(*args), reps), best_ms(lambda _: op(*args), reps)


def bench_decode(op: Callable, batch: int, context: int, reps: int) -> tuple[float, float]:
    heads, kv_lora, rope = 16, 512, 64
    latent = torch.randn(batch * context, kv_lora + rope).bfloat16()
    table = rows_per_request(batch, context)
    chosen = torch.stack([torch.randperm(context)[: min(TOPK, context)] for _ in range(batch)])
    rows = table.gather(1, chosen.sort(dim=1).values)
    q_abs = torch.randn(batch, heads, kv_lora + rope).bfloat16()
    scale = (kv_lora + rope) ** -0.5
    args = (q_abs, latent, rows, kv_lora, scale)
    return best_ms(lambda _: sparse_mla_decode(*args), reps), best_ms(lambda _: op(*args), reps)


def bench_moe(op: Callable, tokens: int, reps: int) -> tuple[float, float]:
    experts, top_k, hidden, inter = 64, 6, 1024, 256
    x = torch.randn(tokens, hidden).bfloat16()
    w13 = (torch.randn(experts, 2 * inter, hidden) * hidden**-0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter) * inter**-0.5).bfloat16()
    choices = [
        torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
        for _ in range(reps + 1)
    ]
    weights = torch.rand(tokens, top_k)
    return (
        best_ms(lambda i: moe_reference(x, w13, w2, weights, choices[i]), reps),
        best_ms(lambda i: op(x, w13, w2, weights, choices[i]), reps),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="default: torch's")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = select_kernels("cpu", torch.bfloat16, True)
    if kernels.op("dsa_indexer_topk") is None:
        raise SystemExit("no compiled kernels on this machine (needs AVX512-BF16)")
    torch.manual_seed(0)
    print(f"CPU: {cpu_model()} [{isa_summary()}], {torch.get_num_threads()} threads")
    print("| kernel | shape | torch ms | kernel ms | ratio |")
    print("| --- | --- | ---: | ---: | ---: |")

    def row(name: str, shape: str, times: tuple[float, float]) -> None:
        ref, got = times
        print(f"| {name} | {shape} | {ref:.2f} | {got:.2f} | {ref / got:.1f}x |", flush=True)

    for batch in BATCHES:
        for context in CONTEXTS:
            shape = f"batch {batch}, context {context}"
            row(
                "indexer",
                shape,
                bench_indexer(kernels.op("dsa_indexer_topk"), batch, context, args.reps),
            )
    for batch in BATCHES:
        for context in CONTEXTS:
            shape = f"batch {batch}, context {context}"
            row(
                "decode",
                shape,
                bench_decode(kernels.op("sparse_mla_decode"), batch, context, args.reps),
            )
    for tokens in (1, 16):
        row("moe", f"{tokens} tokens", bench_moe(kernels.op("moe_experts"), tokens, args.reps))


if __name__ == "__main__":
    main()
