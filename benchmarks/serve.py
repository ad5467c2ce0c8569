"""Load-test a running OpenAI-compatible server (in the spirit of `vllm bench serve`).

    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --num-prompts 200 \
        --request-rate 20 --input-len 64 --output-len 32 --result-file result.json

Sends N streamed requests with random prompts of exactly `--input-len` tokens
(built with the server's own /tokenize and /detokenize), at a Poisson request
rate or as fast as `--max-concurrency` allows, and reports request and token
throughput with TTFT, TPOT, ITL and end-to-end latency at mean/p50/p90/p99.
Any API key is redacted in everything printed or written.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import httpx
from tqdm.auto import tqdm

_WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point "
    "government company number group problem fact river stone light music garden letter window table"
).split()
PERCENTILES = (50, 90, 99)
REDACTED = "<redacted>"


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunks: int = 0  # streamed chunks with text
    error: str = ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    p.add_argument(
        "--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"]
    )
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument(
        "--api-key", default=None, help="API key (default: $OPENAI_API_KEY); never printed"
    )
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens per request")
    p.add_argument(
        "--output-len", type=int, default=32, help="generated tokens per request (EOS ignored)"
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests/s, Poisson arrivals (default: all at once)",
    )
    p.add_argument(
        "--max-concurrency", type=int, default=None, help="most requests in flight at once"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", default=None, help="write the results as JSON here")
    p.add_argument("--disable-tqdm", action="store_true")
    return p.parse_args(argv)


def redacted_args(args: argparse.Namespace) -> dict[str, Any]:
    config = vars(args).copy()
    if config.get("api_key"):
        config["api_key"] = REDACTED
    if config["request_rate"] == float("inf"):
        config["request_rate"] = "inf"  # JSON has no infinity
    return config


def redact(text: str, secret: str | None) -> str:
    return text.replace(secret, REDACTED) if secret else text


async def build_prompts(http: httpx.AsyncClient, args: argparse.Namespace, model: str) -> list[Any]:
    """Random word prompts cut to exactly `input_len` tokens by the server's tokenizer.

    vLLM-style servers (minivllm, `vllm serve`) tokenize at /tokenize and take token-id
    prompts; llama-cpp-python's server tokenizes at /extras/tokenize and takes text only,
    so there the cut ids are detokenized and sent as text (re-tokenization may shift the
    count by a token or two; its usage chunk reports what it saw).
    """
    rng = random.Random(args.seed)
    prompts = []
    extras = (await http.post("/tokenize", json={"model": model, "prompt": "a"})).status_code == 404
    for _ in range(args.num_prompts):
        words = " ".join(rng.choice(_WORDS) for _ in range(args.input_len * 2))
        if extras:
            tokens = await _get_json(http, "POST", "/extras/tokenize", {"input": words})
            ids = tokens["tokens"][: args.input_len]
            text = await _get_json(http, "POST", "/extras/detokenize", {"tokens": ids})
            prompts.append(text["text"])
            continue
        tokens = await _get_json(http, "POST", "/tokenize", {"model": model, "prompt": words})
        ids = tokens["tokens"][: args.input_len]
        if args.endpoint == "/v1/completions":
            prompts.append(ids)
        else:
            text = await _get_json(http, "POST", "/detokenize", {"model": model, "tokens": ids})
            prompts.append(text["prompt"])
    return prompts


class BenchmarkError(Exception):
    """The server refused a set-up call (wrong URL, wrong key, ...)."""


async def _get_json(
    http: httpx.AsyncClient, method: str, path: str, body: dict[str, Any] | None = None
) -> Any:
    response = await http.request(method, path, json=body)
    if response.status_code != 200:
        raise BenchmarkError(f"{method} {path}: HTTP {response.status_code}: {response.text[:300]}")
    return response.json()


def request_body(args: argparse.Namespace, model: str, prompt: Any) -> dict[str, Any]:
    body = {
        "model": model,
        "max_tokens": args.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.endpoint == "/v1/completions":
        return {**body, "prompt": prompt}
    return {**body, "messages": [{"role": "user", "content": prompt}]}


async def send(
    http: httpx.AsyncClient, args: argparse.Namespace, body: dict[str, Any]
) -> RequestResult:
    result = RequestResult(ok=False, prompt_len=args.input_len)
    start = last = time.perf_counter()
    try:
        async with http.stream("POST", args.endpoint, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message", ""))[:300]
                    return result
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.output_len = chunk["usage"]["completion_tokens"]
                    result.prompt_len = chunk["usage"]["prompt_tokens"]
                if not any(_chunk_text(c) for c in chunk.get("choices", [])):
                    continue
                result.chunks += 1
                if result.ttft == 0.0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
        result.latency = time.perf_counter() - start
        result.output_len = result.output_len or result.chunks  # no usage chunk: one token each
        result.ok = True
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {str(exc)[:300]}"
    return result


def _chunk_text(choice: dict[str, Any]) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def run(args: argparse.Namespace) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=args.base_url, headers=headers, timeout=None, limits=limits
    ) as http:
        model = args.model or (await _get_json(http, "GET", "/v1/models"))["data"][0]["id"]
        prompts = await build_prompts(http, args, model)
        rng = random.Random(args.seed + 1)
        gate = asyncio.Semaphore(args.max_concurrency or len(prompts))
        bar = tqdm(
            total=len(prompts), desc="requests", disable=args.disable_tqdm, dynamic_ncols=True
        )

        async def one(prompt: Any) -> RequestResult:
            async with gate:
                result = await send(http, args, request_body(args, model, prompt))
            bar.update(1)
            return result

        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.ensure_future(one(prompt)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return summarize(args, model, results, duration)


def summarize(
    args: argparse.Namespace, model: str, results: list[RequestResult], duration: float
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_len for r in ok)
    input_tokens = sum(r.prompt_len for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    summary: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": model,
        "config": redacted_args(args),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "first_error": next((redact(r.error, args.api_key) for r in results if not r.ok), None),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    for name, values in (
        ("ttft_ms", [r.ttft for r in ok]),
        ("tpot_ms", tpot),
        ("itl_ms", [x for r in ok for x in r.itl]),
        ("e2e_latency_ms", [r.latency for r in ok]),
    ):
        summary[name] = _stats([1000 * v for v in values])
    return summary


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    stats = {"mean": statistics.fmean(ordered)}
    for p in PERCENTILES:
        stats[f"p{p}"] = ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]
    return stats


def report(summary: dict[str, Any]) -> str:
    lines = [
        f"{' Serving benchmark result ':=^60}",
        f"{'Model:':<40}{summary['model']}",
        f"{'Successful requests:':<40}{summary['completed']}",
        f"{'Failed requests:':<40}{summary['failed']}",
        f"{'Benchmark duration (s):':<40}{summary['duration_s']:.2f}",
        f"{'Total input tokens:':<40}{summary['total_input_tokens']}",
        f"{'Total generated tokens:':<40}{summary['total_output_tokens']}",
        f"{'Request throughput (req/s):':<40}{summary['request_throughput']:.2f}",
        f"{'Output token throughput (tok/s):':<40}{summary['output_token_throughput']:.2f}",
        f"{'Total token throughput (tok/s):':<40}{summary['total_token_throughput']:.2f}",
    ]
    titles = {
        "ttft_ms": "Time to First Token",
        "tpot_ms": "Time per Output Token (excl. 1st token)",
        "itl_ms": "Inter-token Latency",
        "e2e_latency_ms": "End-to-end Latency",
    }
    for key, title in titles.items():
        lines.append(f"{' ' + title + ' ':-^60}")
        for stat, value in summary[key].items():
            lines.append(f"{f'{stat.capitalize()} (ms):':<40}{value:.2f}")
    if summary["first_error"]:
        lines.append(f"First error: {summary['first_error']}")
    lines.append("=" * 60)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    print(f"config: {json.dumps(redacted_args(args))}")
    try:
        summary = asyncio.run(run(args))
    except (BenchmarkError, httpx.HTTPError) as exc:
        print(f"error: {redact(str(exc), args.api_key)}", file=sys.stderr)
        return 2
    print(report(summary))
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(summary, f, indent=2)
        print(f"results written to {args.result_file}")
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
