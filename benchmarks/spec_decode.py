"""Speculative decoding against plain decoding, in one process, one configuration after another.

    # target 1: synthetic acceptance 0.8, k = 4, at batch 1 on the 0.6B-shaped checkpoint
    python benchmarks/spec_decode.py --model /tmp/qwen3-0.6b-random --batch 1 \\
        --spec '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                 "rejection_sample_method": "synthetic",
                 "synthetic_acceptance_rates": [0.8, 0.8, 0.8, 0.8]}'
    # real drafts on demo-base (prompts that quote themselves), several batch sizes
    python benchmarks/spec_decode.py --model demo-base --prompts quote --batch 1 16 \\
        --spec '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}' \\
        --spec '{"method": "draft_model", "model": "demo-draft", "num_speculative_tokens": 3}'

Every configuration (plain decoding first) generates the same prompts with greedy decoding
and EOS ignored; output tok/s is end to end (medians of --reps, the configurations timed in
turn within each repetition), the ratio is against plain decoding in the same run, and
acceptance is per draft position (over all repetitions).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

QUOTE = (
    "The for statement in Python differs a bit from what you may be used to in C or Pascal. "
    "Rather than always iterating over an arithmetic progression of numbers, Python's for "
    "statement iterates over the items of any sequence, in the order that they appear."
)


def make_prompts(kind: str, tokenizer, num: int, input_len: int) -> list[list[int]]:
    rng = random.Random(0)
    if kind == "random":
        return [[rng.randrange(3, 1000) for _ in range(input_len)] for _ in range(num)]
    # "quote": a passage, then its opening again, so its continuation is a copy
    ids = tokenizer.encode(QUOTE)
    prompts = []
    for i in range(num):
        cut = 8 + (i % 8)
        prompts.append((ids + tokenizer.encode("\n\nAgain: ") + ids[:cut])[-input_len:])
    return prompts


def make_engine(model: str, spec: dict | None, prompts, output_len: int, dtype: str):
    from minivllm import LLM, SamplingParams

    llm = LLM(
        model,
        dtype=dtype,
        max_model_len=max(len(p["prompt_token_ids"]) for p in prompts) + output_len + 16,
        enable_prefix_caching=False,
        speculative_config=spec,
        # several engines live at once: each takes a fixed budget, not a share of free RAM
        kv_cache_memory_bytes=2 << 30,
    )
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    return llm


def time_once(llm, prompts, output_len: int) -> float:
    from minivllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def measure(model: str, specs: list, prompts, output_len: int, reps: int, dtype: str) -> list:
    """Every configuration's engine is built first; each repetition then times them in
    turn, so a slow spell of the machine hits all of them rather than one."""
    batch = [{"prompt_token_ids": p} for p in prompts]
    engines = [make_engine(model, spec, batch, output_len, dtype) for spec in specs]
    times = [[] for _ in specs]
    for _ in range(reps):
        for i, llm in enumerate(engines):
            times[i].append(time_once(llm, batch, output_len))
    results = []
    for llm, t in zip(engines, times):
        result = {"tok_s": len(prompts) * output_len / statistics.median(t)}
        spec_stats = llm.get_metrics().get("spec_decode")
        if spec_stats:
            result["per_pos"] = spec_stats["acceptance_rate_per_position"]
            result["mean_len"] = spec_stats["mean_acceptance_length"]
        results.append(result)
    for llm in engines:
        llm.llm_engine.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint directory or bundled name")
    parser.add_argument("--spec", action="append", default=[], help="a speculative_config (JSON)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--prompts", choices=["random", "quote"], default="random")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--verbose", action="store_true", help="the engines' INFO log to stderr")
    args = parser.parse_args()
    if args.verbose:
        from minivllm.entrypoints.log import setup_logging

        setup_logging()

    import torch
    from transformers import AutoTokenizer

    from minivllm.engine.arg_utils import resolve_model_path
    from minivllm.kernels.isa import cpu_model, isa_summary

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
    specs = [None] + [json.loads(s) for s in args.spec]
    print(
        f"CPU: {cpu_model()} [{isa_summary()}], {args.threads} threads, torch {torch.__version__}"
    )
    print(
        f"model {args.model}, {args.dtype}, prompts {args.prompts} ({args.input_len} tokens), "
        f"{args.output_len} new tokens, greedy, medians of {args.reps}"
    )
    print(
        "| batch | configuration | output tok/s | vs plain | mean accepted length | acceptance per position |"
    )
    print("| ---: | --- | ---: | ---: | ---: | --- |")
    for batch in args.batch:
        prompts = make_prompts(args.prompts, tokenizer, batch, args.input_len)
        results = measure(args.model, specs, prompts, args.output_len, args.reps, args.dtype)
        base = results[0]["tok_s"]
        for spec, r in zip(specs, results):
            name = "plain" if spec is None else json.dumps(spec, separators=(",", ":"))
            per_pos = " ".join(f"{p:.2f}" for p in r.get("per_pos", []))
            mean_len = f"{r['mean_len']:.2f}" if "mean_len" in r else "-"
            print(
                f"| {batch} | `{name}` | {r['tok_s']:.1f} | {r['tok_s'] / base:.2f}x | "
                f"{mean_len} | {per_pos or '-'} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
