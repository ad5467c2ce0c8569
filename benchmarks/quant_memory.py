"""Memory an engine holds per quantization scheme: resident set after load, and the bytes of
the model's parameters and buffers (quantized rows, scales, prepacked GEMM copies).

    python benchmarks/quant_memory.py --model /tmp/qwen3-0.6b-random
    python benchmarks/quant_memory.py --model /tmp/qwen3-0.6b-random --variants int4 int4_w4a8

Each variant loads in a fresh process (`--child`), so one's freed heap never counts for the
next; the KV cache is held to a fixed 128 MiB so that the figures compare weights. RSS is
the process's VmRSS after `LLM(...)` returns and one token is generated, which includes the
interpreter, torch and the tokenizer (the `bf16` row shows that floor plus bf16 weights).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from tqdm import tqdm

VARIANTS = ("bf16", "int8", "int8_w8a8", "int4", "int4_w4a8")


def child(model: str, variant: str) -> None:
    from minivllm import LLM, SamplingParams

    kwargs = {} if variant == "bf16" else {"quantization": variant}
    if variant.startswith("int4"):
        kwargs["quantization_config"] = {"group_size": 128}
    llm = LLM(
        model,
        dtype="bfloat16",
        max_model_len=1024,
        kv_cache_memory_bytes=128 << 20,
        enable_prefix_caching=False,
        **kwargs,
    )
    params = SamplingParams(temperature=0, max_tokens=1, detokenize=False)
    llm.generate([{"prompt_token_ids": [11, 12, 13, 14]}], params, use_tqdm=False)
    model_ = llm.llm_engine.executor.runner.model
    tensors = {id(t): t for t in [*model_.parameters(), *model_.buffers()]}
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) * 1024
    print(json.dumps({"rss": rss, "weights": weight_bytes}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a checkpoint directory")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.model, args.child)
        return
    from minivllm.kernels.isa import cpu_model

    print(f"CPU: {cpu_model()}; model {args.model}")
    rows = []
    for variant in tqdm(args.variants, desc="variants", unit="load"):
        cmd = [sys.executable, __file__, "--model", args.model, "--child", variant]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"{variant} failed:\n{out.stderr[-2000:]}")
        rows.append((variant, json.loads(out.stdout.strip().splitlines()[-1])))
    print(f"{'variant':<10} {'RSS MiB':>8} {'weights MiB':>12}")
    for variant, got in rows:
        print(f"{variant:<10} {got['rss'] / 2**20:>8.0f} {got['weights'] / 2**20:>12.0f}")


if __name__ == "__main__":
    main()
