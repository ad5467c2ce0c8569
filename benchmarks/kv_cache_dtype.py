"""Decode speed by KV-cache dtype (`kv_cache_dtype`) and context length, in one run.

    python benchmarks/throughput.py --make-qwen3-0.6b /tmp/qwen3-0.6b-random
    python benchmarks/kv_cache_dtype.py --model /tmp/qwen3-0.6b-random \
        --variant int4a8 --contexts 128 1024 2048 --kv-dtypes auto bfloat16 fp8

One engine per KV dtype, all in this process and run one after another (never at the
same time), `--rounds` times interleaved; each figure is the median over rounds. At batch
1 a decode step streams the weights once and the context's keys and values once per layer:
as the context grows the cache's bytes become the larger share, which a bf16 (half an fp32
engine's) or fp8 (a quarter) cache cuts. Per context: tokens/s of a 64-token greedy decode
after a prompt of that length (from the request's first-token and last-token times, so
the prompt's time is not in it), each dtype's ratio to the first, and how many of the 64
greedy tokens equal the first dtype's (random-weight models sit near ties: they part
early).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quant import VARIANTS  # noqa: E402

NEW_TOKENS = 64


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--variant", default="int4a8", choices=sorted(VARIANTS))
    parser.add_argument("--dtype", default="auto", help="the engine's dtype (default: auto)")
    parser.add_argument("--kv-dtypes", nargs="+", default=["auto", "bfloat16", "fp8"])
    parser.add_argument("--contexts", nargs="+", type=int, default=[128, 1024, 2048])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from tqdm import tqdm

    from minivllm import LLM, SamplingParams
    from minivllm.kernels.isa import cpu_model, isa_summary

    max_len = max(args.contexts) + NEW_TOKENS + 8
    engines = {}
    for kv in tqdm(args.kv_dtypes, desc="loading engines"):
        engines[kv] = LLM(
            args.model,
            dtype=args.dtype,
            kv_cache_dtype=kv,
            max_model_len=max_len,
            max_num_seqs=4,
            enable_prefix_caching=False,
            **VARIANTS[args.variant],
        )
    rng = random.Random(0)
    prompts = {c: [rng.randrange(3, 1000) for _ in range(c)] for c in args.contexts}

    def run(llm: LLM, prompt: list[int], new: int) -> tuple[float, list[int]]:
        """Decode tokens/s between the first token and the last (the prompt's time apart),
        from the request's own timestamps, and the tokens."""
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, detokenize=False)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        span = out.metrics.last_token_time - out.metrics.first_token_time
        return (new - 1) / span, list(out.outputs[0].token_ids)

    for llm in engines.values():
        run(llm, prompts[args.contexts[0]], 2)  # warm-up
    rates: dict[tuple[str, int], list[float]] = {}
    tokens: dict[tuple[str, int], list[int]] = {}
    work = [(r, c, kv) for r in range(args.rounds) for c in args.contexts for kv in engines]
    for _, c, kv in tqdm(work, desc="decoding"):
        rate, tokens[kv, c] = run(engines[kv], prompts[c], NEW_TOKENS)
        rates.setdefault((kv, c), []).append(rate)

    import torch

    first = args.kv_dtypes[0]
    print(
        f"\n{cpu_model()} [{isa_summary()}], {torch.get_num_threads()} threads; "
        f"{args.model}, variant {args.variant}, dtype {args.dtype}; "
        f"median of {args.rounds} rounds"
    )
    print("| context | " + " | ".join(f"{kv} tok/s" for kv in args.kv_dtypes) + " |")
    print("|---" * (1 + len(args.kv_dtypes)) + "|")
    for c in args.contexts:
        cells = []
        for kv in args.kv_dtypes:
            rate = statistics.median(rates[kv, c])
            base = statistics.median(rates[first, c])
            same = sum(a == b for a, b in zip(tokens[kv, c], tokens[first, c]))
            note = "" if kv == first else f" ({rate / base:.2f}x, {same}/{NEW_TOKENS} same)"
            cells.append(f"{rate:.2f}{note}")
        print(f"| {c} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
