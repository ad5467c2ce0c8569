"""Side-by-side CPU performance: minivllm vs transformers, beside the machine's limits.

    python benchmarks/throughput.py --make-qwen3-0.6b /tmp/qwen3-0.6b-random
    python benchmarks/compare.py --model /tmp/qwen3-0.6b-random --threads 2 --json out.json

Workloads (token-id prompts, greedy, EOS ignored, medians of --reps runs):
  prefill   one 512-token prompt, 1 new token            -> prompt tok/s
  decode    one 128-token prompt, 128 new tokens         -> decode tok/s (without the first token)
  batch16   16 x (128 in, 128 out)                       -> output tok/s, end to end
  batch64   64 x (256 in, 128 out)                       -> output tok/s, end to end
  startup   LLM() construction to the first token       -> seconds
Limits: memory read bandwidth (fp32 GEMV over 1 GiB), bf16 GEMM TFLOP/s, and from them the
batch-1 decode roof (weight bytes per token / bandwidth) and the prefill roof (FLOPs per token / peak).
Each engine runs in its own subprocess, one after another, so they never share the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

WORKLOADS = ("prefill", "decode", "batch16", "batch64")


def _prompts(num: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(length)] for _ in range(num)]


def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_minivllm(model: str, reps: int, workloads: list[str]) -> dict:
    from minivllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model, dtype="bfloat16", max_model_len=1024, enable_prefix_caching=False)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1), use_tqdm=False)
    result = {"startup_s": time.perf_counter() - start}

    def gen(prompts: list[list[int]], new: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, detokenize=False)
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    return result | _workloads(gen, reps, workloads)


def run_transformers(model: str, reps: int, workloads: list[str]) -> dict:
    return _workloads(transformers_generator(model), reps, workloads)


def transformers_generator(model: str):
    """gen(prompts, new): transformers' bf16 greedy generate of exactly `new` tokens each."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()

    def gen(prompts: list[list[int]], new: int) -> None:
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )

    return gen


def _workloads(gen, reps: int, workloads: list[str]) -> dict:
    out: dict[str, float] = {}
    gen(_prompts(1, 32), 2)  # warm-up
    if "prefill" in workloads:
        p = _prompts(1, 512)
        out["prefill_tok_s"] = 512 / _median_time(lambda: gen(p, 1), reps)
    if "decode" in workloads:
        p = _prompts(1, 128)
        t1 = _median_time(lambda: gen(p, 1), reps)
        t128 = _median_time(lambda: gen(p, 128), reps)
        out["decode_tok_s"] = 127 / (t128 - t1)
        out["decode_e2e_tok_s"] = 128 / t128
    if "batch16" in workloads:
        p = _prompts(16, 128)
        out["batch16_out_tok_s"] = 16 * 128 / _median_time(lambda: gen(p, 128), reps)
    if "batch64" in workloads:
        p = _prompts(64, 256)
        out["batch64_out_tok_s"] = 64 * 128 / _median_time(lambda: gen(p, 128), max(1, reps // 3))
    return out


def hardware_limits(model: str) -> dict:
    import torch
    from safetensors import safe_open

    from minivllm.loader.safetensors_loader import checkpoint_files

    w = torch.randn(16384, 16384)  # 1 GiB fp32, far larger than any cache here
    x = torch.randn(1, 16384)
    read_gbps = w.numel() * 4 / _median_time(lambda: torch.nn.functional.linear(x, w), 5) / 1e9
    w = x = torch.empty(0)  # free the GiB before the GEMM
    a, b = torch.randn(4096, 4096).bfloat16(), torch.randn(4096, 4096).bfloat16()
    torch.matmul(a, b)
    tflops = 2 * 4096**3 / _median_time(lambda: torch.matmul(a, b), 5) / 1e12
    num_params = embed = 0
    for path in checkpoint_files(model):
        with safe_open(path, "pt") as f:
            for name in f.keys():  # noqa: SIM118
                n = 1
                for s in f.get_slice(name).get_shape():
                    n *= s
                num_params += n
                embed += n if "embed_tokens" in name else 0
    # batch 1: every weight once per token (a tied LM head reads the embedding matrix)
    decode_roof = read_gbps * 1e9 / (num_params * 2)
    # prefill: 2 FLOPs per weight per token, without the embedding lookup or LM head (last token only)
    prefill_roof = tflops * 1e12 / (2 * (num_params - embed))
    return {
        "read_GBps": read_gbps,
        "bf16_gemm_TFLOPs": tflops,
        "params": num_params,
        "decode_roof_tok_s": decode_roof,
        "prefill_roof_tok_s": prefill_roof,
    }


def _child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    runners = {"minivllm": run_minivllm, "transformers": run_transformers}
    if args.child == "limits":
        result = hardware_limits(args.model)
    else:
        result = runners[args.child](args.model, args.reps, args.workloads)
    print("RESULT " + json.dumps(result))


def _run_child(name: str, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        name,
        "--model",
        args.model,
        "--threads",
        str(args.threads),
        "--reps",
        str(args.reps),
        "--workloads",
        *args.workloads,
    ]
    return _run(name, cmd)


def _run(name: str, cmd: list[str], env: dict | None = None) -> dict:
    print(f"running {name} ...", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{name} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT ") :])
    for line in proc.stdout.splitlines():
        if line.startswith("INFO "):  # versions and settings, kept in the JSON, not in the table
            print(f"  {name}: {line[5:]}", flush=True)
            result["info"] = json.loads(line[5:])
    return result


def _anchor_runs(args: argparse.Namespace) -> list[tuple[str, list[str], dict | None]]:
    """(column, command, env) for the optional llama.cpp / vLLM anchors (benchmarks/anchors/)."""
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "anchors")
    common = ["--reps", str(args.reps), "--workloads", *args.workloads]
    runs: list[tuple[str, list[str], dict | None]] = []
    for gguf in args.llamacpp_gguf or []:
        quant = os.path.splitext(os.path.basename(gguf))[0].rsplit("-", 1)[-1]
        cmd = [args.llamacpp_python, os.path.join(here, "llamacpp_runner.py"), "--gguf", gguf]
        cmd += ["--threads", str(args.threads), *common]
        cmd += ["--no-extra-bufts"] if args.llamacpp_no_extra_bufts else []
        runs.append((f"llama.cpp-{quant}", cmd, None))
    if args.vllm_python:
        env = dict(os.environ)
        venv = os.path.dirname(os.path.dirname(os.path.abspath(args.vllm_python)))
        preload = [
            p for p in (TCMALLOC, os.path.join(venv, "lib", "libiomp5.so")) if os.path.exists(p)
        ]
        env.setdefault("LD_PRELOAD", ":".join(preload))
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
        cmd = [
            args.vllm_python,
            os.path.join(here, "vllm_runner.py"),
            "--model",
            args.model,
            *common,
        ]
        runs.append(("vllm", cmd, env))
    return runs


TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"  # Debian's libtcmalloc-minimal4


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--engines", nargs="+", default=["minivllm", "transformers"])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--json")
    anchors = parser.add_argument_group("anchors (set up by benchmarks/anchors/setup_anchors.sh)")
    anchors.add_argument("--llamacpp-python", help="python of the llama-cpp-python venv")
    anchors.add_argument("--llamacpp-gguf", nargs="+", help="GGUF file(s), one column each")
    anchors.add_argument(
        "--llamacpp-no-extra-bufts",
        action="store_true",
        help="turn off ggml's AMX/repack weight buffers (llama-bench --repack 0)",
    )
    anchors.add_argument("--vllm-python", help="python of the vllm-cpu venv")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    if bool(args.llamacpp_python) != bool(args.llamacpp_gguf):
        parser.error("--llamacpp-python and --llamacpp-gguf go together")
    results = {"limits": _run_child("limits", args)}
    for engine in args.engines:
        results[engine] = _run_child(engine, args)
    columns = list(args.engines)
    for name, cmd, env in _anchor_runs(args):
        try:
            results[name] = _run(name, cmd, env)
        except RuntimeError as e:  # an anchor failing should not lose the other columns
            print(e, file=sys.stderr)
            results[name] = {"error": str(e)[-2000:]}
        columns.append(name)
    _print_table(results, columns)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


def _print_table(results: dict, engines: list[str]) -> None:
    limits = results["limits"]
    roofs = {
        "prefill_tok_s": limits["prefill_roof_tok_s"],
        "decode_tok_s": limits["decode_roof_tok_s"],
    }
    print(
        f"read {limits['read_GBps']:.1f} GB/s, bf16 GEMM {limits['bf16_gemm_TFLOPs']:.2f} TFLOP/s"
    )
    keys = sorted({k for e in engines for k, v in results[e].items() if isinstance(v, float)})
    header = ["metric", *engines, "roof", *(f"minivllm/{e}" for e in engines if e != "minivllm")]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for key in keys:
        row = [key] + [f"{results[e].get(key, float('nan')):.2f}" for e in engines]
        row.append(f"{roofs[key]:.1f}" if key in roofs else "-")
        for e in engines:
            if e != "minivllm":
                ours, theirs = results["minivllm"].get(key), results[e].get(key)
                better_low = key.endswith("_s") and not key.endswith("tok_s")
                ratio = (
                    (theirs / ours if better_low else ours / theirs)
                    if ours and theirs
                    else float("nan")
                )
                row.append(f"{ratio:.2f}x")
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
