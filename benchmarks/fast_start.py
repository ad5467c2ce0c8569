"""Fast Start: restart-to-first-token and weight-loading time, disk vs the weight cache.

    python benchmarks/fast_start.py --make /tmp/qwen3-0.6b-random --shape 0.6b   # build once
    python benchmarks/fast_start.py --model /tmp/qwen3-0.6b-random --dtype bfloat16
    python benchmarks/fast_start.py --model /tmp/qwen3-4b-random --quantization int8

Each measured start is a fresh process (`--child`) that builds an `LLM` and
generates one token; it reports its phases (imports, weight loading, the rest of
engine start-up, the first token) against CLOCK_MONOTONIC, which all processes
share, so "restart to first token" runs from the parent's spawn to the child's
first token. Disk starts run after one discarded start, so the checkpoint is in the
page cache (the warm case); `--drop-caches` also measures a cold start where
/proc/sys/vm/drop_caches is writable (root). ipc_cache starts map the weights of a
`python -m minivllm.weight_cache` daemon started here with the same flags.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

SHAPES = {
    "0.6b": {},  # QWEN3_0_6B as is
    "4b": dict(
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
    # 16.4 GB in bf16: what an online int8 load could not hold beside its quantized copy
    # on a 24 GiB machine before the load quantized layer by layer
    "8b": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
}


def child(args: argparse.Namespace) -> None:
    from minivllm import LLM, SamplingParams

    imported = time.monotonic()
    kwargs = dict(
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=1 << 30,  # one max_model_len=4096 sequence of the 4B shape
    )
    if args.quantization:
        kwargs["quantization"] = args.quantization
    if args.load_format == "ipc_cache":
        extra = {"socket_dir": args.socket_dir, "fallback": False, "mode": args.mode}
        kwargs.update(load_format="ipc_cache", model_loader_extra_config=extra)
    llm = LLM(args.model, **kwargs)
    ready = time.monotonic()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": [11, 12, 13, 14]}], params, use_tqdm=False)
    first_token = time.monotonic()
    engine = llm.llm_engine
    print(
        json.dumps(
            {
                "imported": imported,
                "load_s": engine.executor.load_seconds,
                "startup_s": engine.startup_seconds,
                "ready": ready,
                "first_token": first_token,
            }
        )
    )


def measure(args: argparse.Namespace, load_format: str, socket_dir: str | None) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--dtype", args.dtype]
    cmd += ["--max-model-len", str(args.max_model_len), "--load-format", load_format]
    cmd += ["--mode", args.mode] + (["--socket-dir", socket_dir] if socket_dir else [])
    cmd += ["--quantization", args.quantization] if args.quantization else []
    spawn = time.monotonic()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    child_times = json.loads(out.strip().splitlines()[-1])
    return {
        "imports_s": child_times["imported"] - spawn,
        "weights_s": child_times["load_s"],
        "engine_start_s": child_times["startup_s"],
        "first_token_s": child_times["first_token"] - spawn,
    }


def summarize(name: str, runs: list[dict]) -> dict:
    row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(
        f"{name:>22}: weights {row['weights_s']:7.3f} s | engine start {row['engine_start_s']:7.3f} s"
        f" | imports {row['imports_s']:6.2f} s | restart to first token {row['first_token_s']:7.2f} s"
        f"  (median of {len(runs)})",
        flush=True,
    )
    return row


def start_daemon(args: argparse.Namespace, socket_dir: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "minivllm.weight_cache", args.model, "--dtype", args.dtype]
    cmd += ["--max-model-len", str(args.max_model_len), "--socket-dir", socket_dir]
    cmd += ["--quantization", args.quantization] if args.quantization else []
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if "READY" in line:
            return proc
    raise RuntimeError(f"daemon exited with {proc.wait()}")


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mode", default="zero_copy", choices=["zero_copy", "copy"])
    parser.add_argument(
        "--quantization",
        help="online quantization for the engines and the daemon (int8, int4, fp8, int8_w8a8): "
        "a disk start then quantizes at every load, a cached one maps the quantized tensors",
    )
    parser.add_argument("--drop-caches", action="store_true")
    parser.add_argument("--make", metavar="DIR", help="build a random checkpoint there and exit")
    parser.add_argument("--shape", default="0.6b", choices=sorted(SHAPES))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--load-format", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--socket-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if args.make:
        return make(args.make, args.shape)
    if not args.model:
        parser.error("--model is required (or --make DIR to build a checkpoint)")
    from minivllm.kernels.isa import cpu_model, isa_summary

    print(
        f"CPU: {cpu_model()} [{isa_summary()}], {os.cpu_count()} cores; model {args.model}"
        f"{', quantization ' + args.quantization if args.quantization else ''}"
    )
    rows = {}
    if args.drop_caches:
        cold = []
        for _ in range(args.repeats):
            if not drop_caches():
                print("cold start skipped: /proc/sys/vm/drop_caches is not writable")
                break
            cold.append(measure(args, "auto", None))
        if cold:
            rows["disk (cold cache)"] = summarize("disk (cold cache)", cold)
    measure(args, "auto", None)  # warms the page cache
    warm = [measure(args, "auto", None) for _ in range(args.repeats)]
    rows["disk (warm cache)"] = summarize("disk (warm cache)", warm)
    socket_dir = tempfile.mkdtemp(prefix="wc", dir="/tmp")
    daemon_start = time.monotonic()
    daemon = start_daemon(args, socket_dir)
    print(f"{'daemon':>22}: ready in {time.monotonic() - daemon_start:.1f} s", flush=True)
    try:
        runs = [measure(args, "ipc_cache", socket_dir) for _ in range(args.repeats)]
        name = f"ipc_cache ({args.mode})"
        rows[name] = summarize(name, runs)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait()
        shutil.rmtree(socket_dir, ignore_errors=True)
    base = rows["disk (warm cache)"]["first_token_s"]
    print(
        f"restart to first token, ipc_cache / warm disk: {rows[name]['first_token_s'] / base:.2f}"
    )


def make(out: str, shape: str) -> None:
    import torch

    from minivllm.utils.random_checkpoint import (
        QWEN3_0_6B,
        make_random_checkpoint,
        pad_tokenizer,
        train_bpe_tokenizer,
    )

    config = {**QWEN3_0_6B, **SHAPES[shape]}
    tokenizer = pad_tokenizer(train_bpe_tokenizer(vocab_size=1000), config["vocab_size"])
    make_random_checkpoint(out, "Qwen3Config", config, tokenizer, torch.bfloat16, 0, "2GB")


if __name__ == "__main__":
    main()
