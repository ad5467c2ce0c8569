"""Offline throughput: minivllm vs transformers `generate` on the same checkpoint, in one run.

    python benchmarks/throughput.py --make-qwen3-0.6b /tmp/qwen3-0.6b-random   # build once
    python benchmarks/throughput.py --model /tmp/qwen3-0.6b-random --dtype bfloat16 --threads 2

Prints tokens/s for each engine and their ratio. Prompts are random token ids,
EOS is ignored, so both engines produce exactly num_requests * output_len tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch


def isa_cap_environment(isa: str) -> dict[str, str]:
    """The variables that cap each library at `isa`: ATen's vectorised kernels, oneDNN's JIT,
    MKL's BLAS and minivllm's own kernels all then take their AVX2 code paths."""
    assert isa == "avx2"
    return {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "MINIVLLM_CPU_ISA": "avx2",
    }


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(num)]


def run_minivllm(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    from minivllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_model_len=args.input_len + args.output_len + 16,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        quantization=args.quantization,
    )
    startup = time.perf_counter() - start
    params = SamplingParams(
        temperature=0, max_tokens=args.output_len, ignore_eos=True, detokenize=False
    )
    llm.generate(
        [{"prompt_token_ids": prompts[0][:16]}], SamplingParams(max_tokens=2), use_tqdm=False
    )
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "engine": "minivllm",
        "seconds": elapsed,
        "output_tokens": num_out,
        "startup_s": startup,
    }


def run_transformers(args: argparse.Namespace, prompts: list[list[int]], dtype: str) -> dict:
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype="auto" if dtype == "auto" else getattr(torch, dtype)
    ).eval()
    batch = args.hf_batch_size or len(prompts)
    start = time.perf_counter()
    num_out = 0
    for i in tqdm(range(0, len(prompts), batch), desc="transformers batches"):
        chunk = prompts[i : i + batch]  # equal lengths: no padding needed, left or right
        with torch.inference_mode():
            out = model.generate(
                torch.tensor(chunk),
                attention_mask=torch.ones(len(chunk), len(chunk[0]), dtype=torch.long),
                max_new_tokens=args.output_len,
                min_new_tokens=args.output_len,
                do_sample=False,
                pad_token_id=0,
            )
        num_out += (out.shape[1] - len(chunk[0])) * len(chunk)
    return {
        "engine": "transformers",
        "dtype": dtype,
        "seconds": time.perf_counter() - start,
        "output_tokens": num_out,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="HF checkpoint directory")
    parser.add_argument(
        "--make-qwen3-0.6b",
        dest="make_dir",
        metavar="DIR",
        help="build a random-weight checkpoint of Qwen3-0.6B's shape (bf16) in DIR and exit",
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["auto", "bfloat16", "float32", "float16"],
        help="minivllm's dtype (auto: the checkpoint's, or float32 on a CPU without "
        "AVX512-BF16) and, unless --transformers-dtype, transformers'",
    )
    parser.add_argument(
        "--transformers-dtype",
        nargs="+",
        default=None,
        choices=["bfloat16", "float32", "float16"],
        help="run transformers once per dtype listed; the ratio is against the fastest",
    )
    parser.add_argument(
        "--emulate-isa",
        choices=["avx2"],
        default=None,
        help="cap every library at this ISA (torch's ATen, oneDNN, MKL and minivllm's "
        "kernels) to estimate an AVX2-only CPU on a newer one",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--make-layers",
        type=int,
        default=None,
        help="with --make-qwen3-0.6b: this many decoder layers instead of 28 (issue 18's "
        "AVX2 figure uses 8)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument(
        "--hf-batch-size", type=int, default=None, help="transformers batch (default: all)"
    )
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument(
        "--quantization", default=None, help="minivllm only: online quantization (int8, int4, ...)"
    )
    parser.add_argument("--output-json", help="write the results here")
    args = parser.parse_args()
    if args.emulate_isa and os.environ.get("MINIVLLM_CPU_ISA") != args.emulate_isa:
        # the caps are read once, when each library loads: start again with them set
        os.environ.update(isa_cap_environment(args.emulate_isa))
        os.execv(sys.executable, [sys.executable, *sys.argv])
    torch.set_num_threads(args.threads)
    if args.make_dir:
        from minivllm.utils.random_checkpoint import (
            QWEN3_0_6B,
            make_random_checkpoint,
            pad_tokenizer,
            train_bpe_tokenizer,
        )

        tokenizer = pad_tokenizer(train_bpe_tokenizer(vocab_size=1000), QWEN3_0_6B["vocab_size"])
        shape = dict(QWEN3_0_6B)
        if args.make_layers:
            shape["num_hidden_layers"] = args.make_layers
        make_random_checkpoint(args.make_dir, "Qwen3Config", shape, tokenizer, torch.bfloat16)
        print(f"wrote {args.make_dir}")
        return
    if not args.model:
        parser.error("--model is required (or --make-qwen3-0.6b DIR to build one)")
    prompts = make_prompts(args.num_requests, args.input_len, 1000, args.seed)
    from minivllm.kernels.isa import cpu_model, isa_summary

    print(
        f"{cpu_model()} ({isa_summary()}{', emulated: ' + args.emulate_isa if args.emulate_isa else ''}), "
        f"{args.threads} threads, {args.num_requests} x ({args.input_len} in, {args.output_len} out)",
        flush=True,
    )
    results = [run_minivllm(args, prompts)]
    if not args.skip_transformers:
        for dtype in args.transformers_dtype or [args.dtype]:
            results.append(run_transformers(args, prompts, dtype))
    for r in results:
        r["output_tok_per_s"] = r["output_tokens"] / r["seconds"]
        print(
            f"{r['engine']:>13} {r.get('dtype', args.dtype):>8}: {r['output_tokens']} output tokens in {r['seconds']:.1f} s "
            f"= {r['output_tok_per_s']:.1f} tok/s"
        )
    if len(results) >= 2:
        best = max(results[1:], key=lambda r: r["output_tok_per_s"])
        print(
            f"ratio minivllm / transformers ({best['dtype']}): "
            f"{results[0]['output_tok_per_s'] / best['output_tok_per_s']:.2f}x"
        )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
