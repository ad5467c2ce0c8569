"""Batch-1 decode with a MoE model's quantized routed experts run in one call per layer
(`kernels/avx2_moe.cpp`'s moe_quantw, fp32 engines on the AVX2 family) against the
Python routing loop (an op per expert), switched within one loaded engine so both see
the same weights, in interleaved rounds. Prints tok/s per round and the ratio.

    python benchmarks/hisparse.py --make-model /tmp/dsv32-400m   # the 400M model, once
    python benchmarks/moe_one_call.py --model /tmp/dsv32-400m --scheme int8_w8a8

Greedy tokens agree for the weight-only schemes. Schemes that quantize activations
(int8_w8a8, int4_w4a8) may part after a few tokens on a random model: the SiLU's last
ulps differ between the two paths, and one activation rounded the other way moves a
logprob by up to ~1e-2, which random weights' near-tied logits cannot absorb.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm import tqdm

from minivllm import LLM, SamplingParams
from minivllm.kernels.isa import cpu_model, isa_summary
from minivllm.quantization.moe_method import QuantizedMoEMethod


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a MoE checkpoint (DeepSeek-style)")
    parser.add_argument("--scheme", default="int8_w8a8", help="the routed experts' scheme")
    parser.add_argument("--tokens", type=int, default=64, help="decode tokens per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(
        args.model,
        max_model_len=512,
        quantization="online",
        quantization_config={"targets": {"re:.*mlp\\.experts$": args.scheme}},
    )
    methods = [
        m.quant_method
        for m in llm.llm_engine.executor.runner.model.modules()
        if isinstance(getattr(m, "quant_method", None), QuantizedMoEMethod)
    ]
    ops = [m.moe_op for m in methods]
    if not methods or any(op is None for op in ops):
        raise SystemExit("no one-call experts here: needs an fp32 engine on the AVX2 kernels")
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(100, 116))}]
    llm.generate(prompt, params, use_tqdm=False)  # warm-up
    rates: dict[str, list[float]] = {"one call": [], "loop": []}
    tokens: dict[str, list[int]] = {}
    print(f"{cpu_model()} ({isa_summary()}), {torch.get_num_threads()} threads, {args.scheme}")
    for round_ in tqdm(range(args.rounds), desc="rounds"):
        for name in ("loop", "one call"):
            for method, op in zip(methods, ops):
                method.moe_op = op if name == "one call" else None
            start = time.perf_counter()
            out = llm.generate(prompt, params, use_tqdm=False)
            rates[name].append(args.tokens / (time.perf_counter() - start))
            tokens[name] = list(out[0].outputs[0].token_ids)
        same = tokens["loop"] == tokens["one call"]
        shown = {k: round(v[-1], 2) for k, v in rates.items()}
        tqdm.write(f"round {round_}: {shown} tok/s, same greedy tokens: {same}")
    one, loop = statistics.median(rates["one call"]), statistics.median(rates["loop"])
    print(f"median: one call {one:.2f} tok/s, loop {loop:.2f} tok/s, {one / loop:.3f}x")
    llm.llm_engine.shutdown()


if __name__ == "__main__":
    main()
