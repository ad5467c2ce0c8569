"""Batch-1 decode with a MoE model's quantized routed experts run in one call per layer
(fp32 engines on the AVX2 family: `kernels/avx2_moe.cpp`'s moe_quantw; bf16 engines on
AVX512-BF16: `kernels/moe_quant.cpp`'s moe_quant_experts) against the Python routing
loop (an op per expert), switched within one loaded engine so both see the same weights,
in interleaved rounds. Prints tok/s per round and the ratio; `--bf16-experts` adds the
same engine's model with unquantized bf16 experts (a second engine, run after).

    python benchmarks/hisparse.py --make-model /tmp/dsv32-400m   # the 400M model, once
    python benchmarks/moe_one_call.py --model /tmp/dsv32-400m --scheme int8_w8a8
    python benchmarks/moe_one_call.py --model /tmp/dsv32-400m --dtype bfloat16 --scheme int4_w4a8 \
        --borrowed-avx2
    python benchmarks/moe_one_call.py --model /tmp/dsv32-400m --dtype bfloat16 \
        --scheme int8_w8a16 --bf16-experts

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
from minivllm.kernels import get_avx2_kernels
from minivllm.kernels.isa import cpu_model, isa_summary
from minivllm.quantization import packing
from minivllm.quantization.moe_method import PARTS, QuantizedMoEMethod


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a MoE checkpoint (DeepSeek-style)")
    parser.add_argument("--scheme", default="int8_w8a8", help="the routed experts' scheme")
    parser.add_argument("--tokens", type=int, default=64, help="decode tokens per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto", help="the engine's dtype (auto, bfloat16, ...)")
    parser.add_argument(
        "--bf16-experts", action="store_true", help="also time the model's unquantized experts"
    )
    parser.add_argument(
        "--borrowed-avx2",
        action="store_true",
        help="also time the loop with every expert on the AVX2 family's op, rows converted to "
        "fp32 (a bf16 engine's int4_w4a8 experts before they ran on VNNI panels)",
    )
    args = parser.parse_args()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_model_len=512,
        quantization="online",
        quantization_config={"targets": {"re:.*mlp\\.experts$": args.scheme}},
    )
    methods = [
        m.quant_method
        for m in llm.llm_engine.executor.runner.model.modules()
        if isinstance(getattr(m, "quant_method", None), QuantizedMoEMethod)
    ]
    attr = "moe_op" if methods and methods[0].moe_op is not None else "bf16_moe_op"
    ops = [getattr(m, attr) for m in methods]
    if not methods or any(op is None for op in ops):
        raise SystemExit(
            "no one-call experts here: needs an fp32 engine on the AVX2 kernels or a bf16 "
            "engine on the AVX512-BF16 ones"
        )
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(100, 116))}]
    llm.generate(prompt, params, use_tqdm=False)  # warm-up
    names = ["loop", "one call"] + (["borrowed AVX2"] if args.borrowed_avx2 else [])
    experts = [
        (e, e.op, e.fp32_op, e.quant_weights) for m in methods for p in PARTS for e in m.experts[p]
    ]
    # the AVX2 op reads rows, which experts on their VNNI panels no longer keep
    with_rows = [
        packing.with_rows(e[3], e[3].packed) if args.borrowed_avx2 else None for e in experts
    ]
    avx2 = get_avx2_kernels() if args.borrowed_avx2 else None
    if args.borrowed_avx2 and (avx2 is None or attr != "bf16_moe_op"):
        raise SystemExit("--borrowed-avx2 needs a bf16 engine and the AVX2 family")
    rates: dict[str, list[float]] = {name: [] for name in names}
    tokens: dict[str, list[int]] = {}
    print(f"{cpu_model()} ({isa_summary()}), {torch.get_num_threads()} threads, {args.scheme}")
    for round_ in tqdm(range(args.rounds), desc="rounds"):
        for name in names:
            for method, op in zip(methods, ops):
                setattr(method, attr, op if name == "one call" else None)
            for (expert, op, fp32_op, own), rows in zip(experts, with_rows):
                borrowed = name == "borrowed AVX2"  # the borrowed op, or each expert's own
                expert.op = None if borrowed else op
                expert.fp32_op = avx2.linear_quantw if borrowed else fp32_op
                expert.quant_weights = rows if borrowed else own
            start = time.perf_counter()
            out = llm.generate(prompt, params, use_tqdm=False)
            rates[name].append(args.tokens / (time.perf_counter() - start))
            tokens[name] = list(out[0].outputs[0].token_ids)
        same = tokens["loop"] == tokens["one call"]
        shown = {k: round(v[-1], 2) for k, v in rates.items()}
        tqdm.write(f"round {round_}: {shown} tok/s, same greedy tokens: {same}")
    one, loop = statistics.median(rates["one call"]), statistics.median(rates["loop"])
    print(f"median: one call {one:.2f} tok/s, loop {loop:.2f} tok/s, {one / loop:.3f}x")
    if args.borrowed_avx2:
        old = statistics.median(rates["borrowed AVX2"])
        print(f"median: borrowed AVX2 op {old:.2f} tok/s; one call {one / old:.3f}x of it")
    llm.llm_engine.shutdown()
    if args.bf16_experts:
        del llm
        plain = LLM(args.model, dtype=args.dtype, max_model_len=512)
        plain.generate(prompt, params, use_tqdm=False)  # warm-up
        bf16 = []
        for _ in tqdm(range(args.rounds), desc="unquantized experts"):
            start = time.perf_counter()
            plain.generate(prompt, params, use_tqdm=False)
            bf16.append(args.tokens / (time.perf_counter() - start))
        base = statistics.median(bf16)
        print(
            f"unquantized experts {base:.2f} tok/s: one call {one / base:.3f}x, "
            f"loop {loop / base:.3f}x of it"
        )
        plain.llm_engine.shutdown()


if __name__ == "__main__":
    main()
