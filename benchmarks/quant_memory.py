"""Memory an engine holds per quantization scheme: resident set after load, its peak during
the load, and the bytes of the model's parameters and buffers (quantized rows, scales,
prepacked GEMM copies).

    python benchmarks/quant_memory.py --model /tmp/qwen3-0.6b-random
    python benchmarks/quant_memory.py --model /tmp/qwen3-0.6b-random --variants int4 int4_w4a8

Each variant loads in a fresh process (`--child`), so one's freed heap never counts for the
next; the KV cache is held to a fixed 128 MiB so that the figures compare weights. RSS is
the process's VmRSS after `LLM(...)` returns and one token is generated, VmHWM its peak
(both count the checkpoint's file pages the load mapped, which the kernel can reclaim),
anon and peak anon the anonymous part alone (the peak sampled every 5 ms); all include
the interpreter, torch and the tokenizer (the `bf16` row shows that floor plus bf16
weights). load is the model's load and processing in seconds (`ModelRunner.load_seconds`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading

from tqdm import tqdm

VARIANTS = ("bf16", "int8", "int8_w8a8", "int4", "int4_w4a8")


def _status() -> dict[str, int]:
    """/proc/self/status's memory fields, bytes."""
    with open("/proc/self/status") as f:
        return {
            line.split(":")[0]: int(line.split()[1]) * 1024
            for line in f
            if line.startswith(("Vm", "Rss"))
        }


def _watch_anon(peak: list[int], stop: threading.Event) -> None:
    """Sample RssAnon every 5 ms into peak[0]: the kernel keeps no high-water mark of
    anonymous memory, and VmHWM also counts the checkpoint's mapped (reclaimable) pages."""
    while not stop.wait(0.005):
        peak[0] = max(peak[0], _status()["RssAnon"])


def child(model: str, variant: str) -> None:
    from minivllm import LLM, SamplingParams

    peak_anon, stop = [0], threading.Event()
    watcher = threading.Thread(target=_watch_anon, args=(peak_anon, stop), daemon=True)
    watcher.start()

    kwargs = {} if variant == "bf16" else {"quantization": variant}
    if variant.startswith("int4"):
        kwargs["quantization_config"] = {"group_size": 128}
    llm = LLM(
        model,
        dtype="bfloat16",
        max_model_len=512,
        kv_cache_memory_bytes=128 << 20,
        enable_prefix_caching=False,
        **kwargs,
    )
    params = SamplingParams(temperature=0, max_tokens=1, detokenize=False)
    llm.generate([{"prompt_token_ids": [11, 12, 13, 14]}], params, use_tqdm=False)
    model_ = llm.llm_engine.executor.runner.model
    tensors = {id(t): t for t in [*model_.parameters(), *model_.buffers()]}
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    stop.set()
    watcher.join()
    status = _status()
    got = {"rss": status["VmRSS"], "anon": status["RssAnon"], "peak_anon": peak_anon[0]}
    load = llm.llm_engine.executor.runner.load_seconds
    print(json.dumps({**got, "peak": status["VmHWM"], "weights": weight_bytes, "load": load}))


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
    keys = ("rss", "peak", "anon", "peak_anon", "weights")
    heads = ("RSS", "VmHWM", "anon", "peak anon", "weights")
    print(f"{'MiB':<10}" + "".join(f"{h:>11}" for h in heads) + f"{'load (s)':>11}")
    for variant, got in rows:
        mib = "".join(f"{got[k] / 2**20:>11.0f}" for k in keys)
        print(f"{variant:<10}{mib}{got['load']:>11.2f}")


if __name__ == "__main__":
    main()
