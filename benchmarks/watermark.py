"""Watermarking's cost and detection power.

    # throughput with and without the watermark, in one process (engines timed in turn)
    python benchmarks/watermark.py cost --model /tmp/qwen3-0.6b-random --batch 1 16 64
    # detection rate against scored tokens on demo-base
    python benchmarks/watermark.py power --num 40

`cost` samples at temperature 1 with EOS ignored; the ratio is watermarked over plain
output tok/s (medians of --reps). `power` generates --num completions per cell at
temperature 0.7 and 1.0, single and dual key, with and without speculative decoding
(dual key with EAGLE, probabilistic drafts), and prints the share detected at p <= 0.01
when only the first L tokens are scored.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

KEY = 0x5EED_CAFE_F00D


def cost(args: argparse.Namespace) -> None:
    import torch

    from minivllm import LLM, SamplingParams
    from minivllm.kernels.isa import cpu_model, isa_summary

    torch.set_num_threads(args.threads)
    print(
        f"CPU: {cpu_model()} [{isa_summary()}], {args.threads} threads, torch {torch.__version__}"
    )
    print(
        f"model {args.model}, {args.dtype}, {args.input_len}-token prompts, {args.output_len} new"
    )
    print("| batch | plain tok/s | watermarked tok/s | ratio |")
    print("| ---: | ---: | ---: | ---: |")
    rng = random.Random(0)
    for batch in args.batch:
        prompts = [
            {"prompt_token_ids": [rng.randrange(3, 1000) for _ in range(args.input_len)]}
            for _ in range(batch)
        ]
        engines = [
            LLM(
                args.model,
                dtype=args.dtype,
                enable_prefix_caching=False,
                max_model_len=args.input_len + args.output_len + 8,
                watermark_config=wm,
                kv_cache_memory_bytes=2 << 30,
            )
            for wm in (None, {"key": KEY})
        ]
        params = SamplingParams(
            temperature=1.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False
        )
        for llm in engines:
            llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)
        times = [[], []]
        for _ in range(args.reps):
            for i, llm in enumerate(engines):
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                times[i].append(time.perf_counter() - start)
        rates = [batch * args.output_len / statistics.median(t) for t in times]
        print(
            f"| {batch} | {rates[0]:.1f} | {rates[1]:.1f} | {rates[1] / rates[0]:.3f} |", flush=True
        )
        for llm in engines:
            llm.llm_engine.shutdown()


def power(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from minivllm import LLM, SamplingParams
    from minivllm.watermark.config import WatermarkConfig
    from minivllm.watermark.detector import detect

    starts = [
        "The for statement in Python",
        "A dictionary is",
        "To open a file for reading,",
        "This module provides",
        "The os module",
        "Exceptions are",
        "A class is",
        "The standard library",
    ]
    prompts = [f"{starts[i % len(starts)]} {i}" for i in range(args.num)]
    eagle = {
        "method": "eagle",
        "model": "demo-eagle",
        "num_speculative_tokens": 3,
        "draft_sample_method": "probabilistic",
    }
    cells = [
        ("single", {"key": KEY}, None),
        ("dual", {"key": KEY, "algorithm": "dual_key_gumbel"}, None),
        ("dual + eagle", {"key": KEY, "algorithm": "dual_key_gumbel"}, eagle),
    ]
    lengths = [5, 10, 15, 25, 50, 100]
    print(
        f"demo-base, {args.num} completions per cell, detection rate at p <= 0.01 "
        f"scoring the first L tokens"
    )
    print("| configuration | temperature | " + " | ".join(f"L={n}" for n in lengths) + " |")
    print("| --- | ---: |" + " ---: |" * len(lengths))
    for name, wm, spec in cells:
        llm = LLM("demo-base", dtype="float32", watermark_config=wm, speculative_config=spec)
        config = WatermarkConfig.from_value(wm)
        for temperature in (0.7, 1.0):
            params = SamplingParams(temperature=temperature, max_tokens=200, ignore_eos=True)
            outs = llm.generate(prompts, params, use_tqdm=False)
            rates = []
            for n in tqdm(lengths, desc=f"{name} T={temperature}", leave=False):
                hits = [
                    detect(list(o.outputs[0].token_ids)[:n], config).is_watermarked for o in outs
                ]
                rates.append(sum(hits) / len(hits))
            print(
                f"| {name} | {temperature} | " + " | ".join(f"{r:.2f}" for r in rates) + " |",
                flush=True,
            )
        llm.llm_engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("cost", help="throughput with and without the watermark")
    c.add_argument("--model", required=True)
    c.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    c.add_argument("--input-len", type=int, default=64)
    c.add_argument("--output-len", type=int, default=64)
    c.add_argument("--reps", type=int, default=3)
    c.add_argument("--dtype", default="bfloat16")
    c.add_argument("--threads", type=int, default=2)
    p = sub.add_parser("power", help="detection rate against scored tokens")
    p.add_argument("--num", type=int, default=40)
    args = parser.parse_args()
    cost(args) if args.command == "cost" else power(args)


if __name__ == "__main__":
    main()
