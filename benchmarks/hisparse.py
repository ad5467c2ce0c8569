"""DeepSeek sparse attention and HiSparse on this CPU: minivllm against transformers.

    python benchmarks/hisparse.py --make-model /tmp/dsv32-400m
    python benchmarks/hisparse.py --model /tmp/dsv32-400m --sections throughput context hisparse

The model is DeepSeek-V3.2's shape scaled to ~400M parameters (random weights, bf16):
hidden 1024, 12 layers (1 dense, 11 MoE of 32 experts, top-4 in 4 groups, 1 shared),
16 heads of MLA (q_lora 384, kv_lora 256, nope 64, rope 32, v 64), an indexer of 16 x 64
heads, index_topk 512.

Sections (greedy, EOS ignored; prefill is never counted: for `throughput` decode time =
time(prompt + 1 + N tokens) - time(prompt + 1 token), medians of --reps, the same for
both engines; the minivllm-only sections time the engine's steps after every request
has its first token, one run each):
  throughput  decode tok/s at batch 1 and 16 after 1,024-token prompts, minivllm vs
              transformers (each engine in its own subprocess, one after the other)
  context     minivllm batch-1 decode ms/token at contexts 1k ... 32k: flat once the
              context passes index_topk (the indexer's scan is the only part that grows)
  hisparse    the host tier on vs all-resident: decode tok/s, hit rate and spills against
              context length and concurrency, with the pool in RAM and in an mmap file;
              and the cost of one miss (resolver microbenchmark: all hits vs all misses)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

DSV32_400M = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    moe_intermediate_size=256,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=384,
    kv_lora_rank=256,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    index_n_heads=16,
    index_head_dim=64,
    index_topk=512,
    n_routed_experts=32,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
)


def make_model(out: str) -> None:
    from minivllm.utils.random_checkpoint import (
        make_random_checkpoint,
        pad_tokenizer,
        train_bpe_tokenizer,
    )

    tokenizer = pad_tokenizer(train_bpe_tokenizer(vocab_size=500), DSV32_400M["vocab_size"])
    import torch

    make_random_checkpoint(out, "DeepseekV32Config", DSV32_400M, tokenizer, torch.bfloat16)
    print(f"wrote {out}")


def _prompts(num: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 30000) for _ in range(length)] for _ in range(num)]


def _decode_seconds(gen, prompts, new: int, reps: int) -> float:
    """Median over reps of time(1 + new tokens) - time(1 token)."""
    diffs = []
    for _ in range(reps):
        start = time.perf_counter()
        gen(prompts, 1)
        first = time.perf_counter() - start
        start = time.perf_counter()
        gen(prompts, 1 + new)
        diffs.append(time.perf_counter() - start - first)
    return statistics.median(diffs)


def _stepped_decode_seconds(llm, prompts, new: int) -> float:
    """minivllm alone: step the engine through the prefill (until every request has its
    first token), then time the steps of the remaining `new` tokens."""
    from minivllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=1 + new, ignore_eos=True, detokenize=False)
    for p in prompts:
        engine.add_request(None, {"prompt_token_ids": p}, params)
    requests = engine.scheduler.requests
    while engine.scheduler.waiting or any(r.num_output_tokens < 1 for r in requests.values()):
        engine.step()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def _minivllm_gen(model: str, max_model_len: int, **kwargs):
    from minivllm import LLM, SamplingParams

    llm = LLM(
        model,
        dtype="bfloat16",
        max_model_len=max_model_len,
        enable_prefix_caching=False,
        **kwargs,
    )

    def gen(prompts, new):
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, detokenize=False)
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    return llm, gen


def throughput_child(engine: str, model: str, reps: int, new: int) -> dict:
    result = {}
    if engine == "minivllm":
        _, gen = _minivllm_gen(model, 2048)
    else:
        sys.path.insert(0, os.path.dirname(__file__))
        from compare import transformers_generator

        gen = transformers_generator(model)
    for batch in (1, 16):
        prompts = _prompts(batch, 1024, seed=batch)
        seconds = _decode_seconds(gen, prompts, new, reps)
        result[f"batch{batch}_tok_s"] = batch * new / seconds
    return result


def context_child(model: str, reps: int, new: int, contexts: list[int]) -> dict:
    llm, _ = _minivllm_gen(model, max(contexts) + new + 8, max_num_batched_tokens=1024)
    result = {}
    for ctx in contexts:
        seconds = _stepped_decode_seconds(llm, _prompts(1, ctx, seed=ctx), new)
        result[str(ctx)] = 1000 * seconds / new
        print(f"  context {ctx}: {result[str(ctx)]:.1f} ms/token", file=sys.stderr, flush=True)
    return result


def hisparse_child(model: str, reps: int, new: int, context: int, batch: int, mode: str) -> dict:
    """One configuration: mode is resident, ram or mmap. The tier runs get a device budget
    of a quarter of the batch's context; the resident run enough for all of it."""
    per_token = DSV32_400M["num_hidden_layers"] * (256 + 32 + 64) * 2
    total = batch * (context + new + 64)
    kwargs: dict = dict(max_num_batched_tokens=1024, max_num_seqs=batch)
    if mode == "resident":
        kwargs["kv_cache_memory_bytes"] = int(1.2 * total * per_token) + (64 << 20)
    else:
        extra = {"host_pool_gib": 1.5 * total * per_token / 2**30}
        if mode == "mmap":
            extra["host_pool_file"] = os.path.join(tempfile.gettempdir(), "hisparse-bench.pool")
        kwargs["kv_cache_memory_bytes"] = max(total // 4, 4096) * per_token
        kwargs["kv_transfer_config"] = {
            "kv_connector": "HiSparseConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    llm, _ = _minivllm_gen(model, context + new + 64, **kwargs)
    prompts = _prompts(batch, context, seed=context + batch)
    seconds = _stepped_decode_seconds(llm, prompts, new)
    stats = llm.llm_engine.stats()
    out = {"tok_s": batch * new / seconds, "preemptions": stats.num_preemptions}
    if stats.hisparse is not None:
        hs = stats.hisparse
        out |= {
            "hit_rate": hs.hits / max(hs.lookups, 1),
            "lookups": hs.lookups,
            "spills": hs.spills,
            "h2d_MiB": hs.host_to_device_bytes / 2**20,
        }
    return out


def miss_cost() -> dict:
    """Microseconds per resolved row: a resolve of 512 tokens all in the hot buffer, and
    one of 512 all copied in from the host pool (rows of 288 bf16 values, RAM pool)."""
    import torch

    from minivllm.hisparse.config import HiSparseConfig
    from minivllm.hisparse.runtime import HiSparseRuntime
    from minivllm.layers.attention.kv_cache_spec import MLAAttentionSpec

    class Layer:  # what the runtime reads of an MLA layer
        def __init__(self):
            self.kv_cache = (torch.zeros(64, 16, 288, dtype=torch.bfloat16), None)

        def get_kv_cache_spec(self, block_size, dtype):
            return MLAAttentionSpec(block_size, dtype, 256, 32, 64)

    topk, context = 512, 32768
    rt = HiSparseRuntime(
        HiSparseConfig(1.0),
        [Layer()],
        64,
        context // 16 + 8,
        16,
        2 * topk,
        torch.bfloat16,
        None,
        0,
    )
    rt.pool.storage.normal_()
    from minivllm.hisparse.coordinator import HiSparseStepMetadata

    rt.apply(HiSparseStepMetadata(hot_blocks={"r": list(range(2 * topk // 16))}), {})
    token_rows = torch.arange(context) + rt.num_device_rows  # every page on the host
    result = {}
    for name, fresh in (("miss_us", True), ("hit_us", False)):
        times = []
        for rep in range(20):
            rt.step += 1
            start_tok = (rep * topk) % (context - topk) if fresh else 0
            indices = torch.arange(start_tok, start_tok + topk).unsqueeze(0)
            if not fresh and rep == 0:
                rt.resolve(0, "r", indices, token_rows)  # warm the buffer
                rt.step += 1
            start = time.perf_counter()
            rt.resolve(0, "r", indices, token_rows)
            times.append(time.perf_counter() - start)
        result[name] = 1e6 * statistics.median(times) / topk
    return result


def _child(args: argparse.Namespace) -> None:
    if args.child == "throughput":
        out = throughput_child(args.engine, args.model, args.reps, args.new)
    elif args.child == "context":
        out = context_child(args.model, args.reps, args.new, args.contexts)
    elif args.child == "hisparse":
        out = hisparse_child(args.model, args.reps, args.new, args.context, args.batch, args.mode)
    else:
        out = miss_cost()
    print("RESULT " + json.dumps(out), flush=True)


def _run(extra: list[str], args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--model", args.model, "--reps", str(args.reps)]
    cmd += ["--new", str(args.new), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{' '.join(extra)} failed:\n{proc.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--make-model", metavar="DIR", help="write the benchmark model to DIR")
    parser.add_argument("--model", default="/tmp/dsv32-400m")
    parser.add_argument("--sections", nargs="+", default=["throughput", "context", "hisparse"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--new", type=int, default=32, help="decode tokens per measurement")
    parser.add_argument(
        "--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768]
    )
    parser.add_argument("--json", help="also write the results here")
    # a child process measures one configuration
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--context", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make_model:
        make_model(args.make_model)
        return
    if args.child:
        _child(args)
        return
    from minivllm.kernels.isa import cpu_model, isa_summary

    results: dict = {"cpu": f"{cpu_model()} [{isa_summary()}]", "threads": os.cpu_count()}
    print(f"CPU: {results['cpu']}")
    if "throughput" in args.sections:
        rows = {
            e: _run(["--child", "throughput", "--engine", e], args)
            for e in ("minivllm", "transformers")
        }
        results["throughput"] = rows
        print("\ndecode tok/s after 1,024-token prompts   minivllm   transformers   ratio")
        for b in (1, 16):
            ours, theirs = (
                rows["minivllm"][f"batch{b}_tok_s"],
                rows["transformers"][f"batch{b}_tok_s"],
            )
            print(
                f"  batch {b:>2}                               {ours:8.1f}   {theirs:12.1f}   {ours / theirs:5.2f}x"
            )
    if "context" in args.sections:
        rows = _run(["--child", "context", "--contexts", *map(str, args.contexts)], args)
        results["context"] = rows
        print("\nminivllm batch-1 decode, ms/token by context (index_topk 512)")
        for ctx, ms in rows.items():
            print(f"  {int(ctx):>6} tokens   {ms:7.1f}")
    if "hisparse" in args.sections:
        table = []
        for context, batch in ((4096, 1), (4096, 4), (16384, 1)):
            for mode in ("resident", "ram", "mmap"):
                row = _run(
                    [
                        "--child",
                        "hisparse",
                        "--context",
                        str(context),
                        "--batch",
                        str(batch),
                        "--mode",
                        mode,
                    ],
                    args,
                )
                table.append({"context": context, "batch": batch, "mode": mode, **row})
        results["hisparse"] = table
        results["miss_cost"] = _run(["--child", "miss"], args)
        print("\nHiSparse (device budget: a quarter of the batch's context)")
        print("  context batch mode       tok/s  hit rate  spills  preempt")
        for r in table:
            hit = f"{r['hit_rate']:.2f}" if "hit_rate" in r else "  - "
            print(
                f"  {r['context']:>7} {r['batch']:>5} {r['mode']:<9} {r['tok_s']:7.1f}  {hit:>8}"
                f"  {r.get('spills', 0):>6}  {r['preemptions']:>7}"
            )
        mc = results["miss_cost"]
        print(f"  resolver: {mc['hit_us']:.2f} us per hit, {mc['miss_us']:.2f} us per miss (row)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
