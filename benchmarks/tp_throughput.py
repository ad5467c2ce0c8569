"""Offline throughput with tensor parallelism: TP=1 against TP=2 (or more) on one checkpoint.

    python benchmarks/throughput.py --make-qwen3-0.6b /tmp/qwen3-0.6b-random   # build once
    python benchmarks/tp_throughput.py --model /tmp/qwen3-0.6b-random --tp 1 2

For each TP size, in turn (one engine alive at a time): a batch of random-token
prompts (EOS ignored, so every run makes num_requests * output_len tokens), then
one request alone (its decode speed, where TP is meant to help on GPUs). The
machine's threads are split between the ranks of a host (torch threads / TP).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time

import torch


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(length)]} for _ in range(num)
    ]


def run(args: argparse.Namespace, tp: int) -> dict:
    from minivllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        tensor_parallel_size=tp,
        max_model_len=args.input_len + args.output_len + 16,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
    )
    startup = time.perf_counter() - start
    params = SamplingParams(
        temperature=0, max_tokens=args.output_len, ignore_eos=True, detokenize=False
    )
    prompts = make_prompts(args.num_requests, args.input_len, 1000, args.seed)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    batch_s = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    start = time.perf_counter()
    llm.generate(prompts[:1], params, use_tqdm=False)
    single_s = time.perf_counter() - start
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    return {
        "tensor_parallel_size": tp,
        "startup_s": startup,
        "batch_output_tokens": num_out,
        "batch_s": batch_s,
        "batch_tok_per_s": num_out / batch_s,
        "single_request_tok_per_s": args.output_len / single_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="HF checkpoint directory")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="TP sizes to compare")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--threads", type=int, default=2, help="torch threads, split among ranks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30, help="per rank")
    parser.add_argument("--output-json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = [run(args, tp) for tp in args.tp]
    for r in results:
        print(
            f"TP={r['tensor_parallel_size']}: batch {r['batch_output_tokens']} tokens in "
            f"{r['batch_s']:.1f} s = {r['batch_tok_per_s']:.1f} tok/s; one request "
            f"{r['single_request_tok_per_s']:.1f} tok/s; start-up {r['startup_s']:.1f} s"
        )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
