"""Decode throughput with many sampled rows: temperature 1, penalties on, batch 64.

    python benchmarks/sampling_batch.py --model /tmp/qwen3-0.6b-random

Reports output tok/s end to end and the sampler's share (the runner's sampling
metadata and draw), medians of --reps runs. The same token-id prompts every run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="HF checkpoint directory")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from minivllm import LLM, SamplingParams
    from minivllm.kernels.isa import cpu_model, isa_summary

    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, 1000) for _ in range(args.input_len)]}
        for _ in range(args.batch)
    ]
    llm = LLM(args.model, dtype="bfloat16", max_model_len=1024, enable_prefix_caching=False)
    params = SamplingParams(
        temperature=1.0,
        top_p=0.95,
        repetition_penalty=1.1,
        frequency_penalty=0.2,
        presence_penalty=0.1,
        max_tokens=args.output_len,
        ignore_eos=True,
        detokenize=False,
        seed=None,
    )
    llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)
    times = []
    for _ in range(args.reps):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    tokens = args.batch * args.output_len
    print(
        f"CPU: {cpu_model()} [{isa_summary()}], {args.threads} threads, torch {torch.__version__}"
    )
    print(
        f"{args.batch} x ({args.input_len} in, {args.output_len} out), temperature 1, top-p 0.95, "
        f"repetition/frequency/presence penalties: {tokens / seconds:.1f} output tok/s "
        f"(median of {args.reps}: {seconds:.2f} s; runs {', '.join(f'{t:.2f}' for t in times)})"
    )


if __name__ == "__main__":
    main()
