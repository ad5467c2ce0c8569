"""How often each quantization scheme's greedy output equals bf16's, on the bundled demo-base.

    python benchmarks/quant_agreement.py [--model demo-base] [--tokens 48]

For each scheme: the share of generated positions whose token equals bf16's, and the
mean length of the common prefix (after the first divergence the continuations differ
by construction, so the prefix is the stricter figure). Each scheme quantizes every
linear layer (the shorthand; LM head in bf16), with our kernels where the CPU has them.
"""

from __future__ import annotations

import argparse

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, there was",
    "In the beginning",
    "The capital of France is",
    "def fibonacci(n):",
    "import numpy as np\n",
    "She opened the door and",
    "Water boils at",
    "The meaning of life is",
    "My favourite food is",
    "Yesterday I went to the",
    "The best way to learn is",
    "class Stack:\n",
    "It was a dark and stormy night",
    "Dear Sir or Madam,",
    "The weather today is",
]
SCHEMES = ("int8_w8a16", "int8_w8a8", "fp8_w8a16", "int4_w4a16", "int4_w4a8")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="demo-base")
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()

    from minivllm import LLM, SamplingParams
    from minivllm.kernels.isa import cpu_model, isa_summary

    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    outputs = {}
    for scheme in ("bf16", *SCHEMES):
        quant = {} if scheme == "bf16" else {"quantization": scheme}
        llm = LLM(args.model, dtype="bfloat16", max_model_len=256, **quant)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        outputs[scheme] = [o.outputs[0].token_ids for o in outs]
        del llm
    print(
        f"CPU: {cpu_model()} ({isa_summary()}); {args.model}, {len(PROMPTS)} prompts x {args.tokens} greedy tokens"
    )
    print("| scheme | tokens equal to bf16's | mean common prefix (tokens) |")
    print("|---|---|---|")
    base = outputs["bf16"]
    for scheme in SCHEMES:
        same = sum(a == b for ours, ref in zip(outputs[scheme], base) for a, b in zip(ours, ref))
        prefixes = [_prefix(ours, ref) for ours, ref in zip(outputs[scheme], base)]
        total = sum(len(ref) for ref in base)
        print(
            f"| {scheme} | {same / total:.1%} | {sum(prefixes) / len(prefixes):.1f} of {args.tokens} |"
        )


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


if __name__ == "__main__":
    main()
