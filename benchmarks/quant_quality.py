"""What each quantization scheme costs in quality: held-out perplexity and KL divergence to bf16.

    apt-get install -y python3.11-doc && python tools/prepare_corpus.py --out /tmp/corpus
    python benchmarks/quant_quality.py --heldout /tmp/corpus/heldout.txt \
        [--kl-model /tmp/qwen3-0.6b-random] [--schemes int8_w8a16 int4_w4a16 ...] \
        [--kv-cache-dtypes bfloat16 fp8 fp8_e5m2] [--lm-head]

Perplexity runs through minivllm itself: the bundled demo-base (a trained model) scores
every non-overlapping 256-token window of the held-out documents (the demo models'
evaluation, docs/demo-models.md) with `prompt_logprobs=0`, once unquantized and once per
scheme (the shorthand's layers: every linear layer but the LM head; `--lm-head` adds a
row per scheme with the LM head in the scheme too, as `benchmarks/quant.py`'s `-all`
variants run), and the table gives exp(mean NLL) and its change against the unquantized
run.

KL divergence needs whole distributions, which the engine's API does not return (as
vLLM's does not): it is taken in transformers, with each linear layer's forward replaced
by the scheme's plain-PyTorch reference (`formats.reference_linear`, the contract the
kernels are tested against) on weights quantized as the engine quantizes them. Reported
as the mean over positions of KL(P_bf16 || P_scheme) in nats, on demo-base's held-out
windows and, with --kl-model, on a checkpoint such as the Qwen3-0.6B shape (random
token ids as input: a random-weight model has no text to score).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

from minivllm.config import KV_CACHE_DTYPES

SCHEMES = ("int8_w8a16", "int8_w8a8", "fp8_w8a16", "int4_w4a16", "int4_w4a8")
WINDOW = 256


def heldout_windows(path: str, model: str, limit: int | None) -> list[list[int]]:
    """Non-overlapping WINDOW-token windows of the held-out text, tokenized as a stream."""
    from transformers import AutoTokenizer

    from minivllm.loader.hub import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(model))
    with open(path, encoding="utf-8") as f:
        ids = tokenizer(f.read())["input_ids"]
    windows = [ids[i : i + WINDOW] for i in range(0, len(ids) - WINDOW + 1, WINDOW)]
    return windows[:limit] if limit else windows


def engine_nll(
    model: str,
    scheme: str | None,
    windows: list[list[int]],
    kv_cache_dtype: str = "auto",
    lm_head: bool = False,
) -> float:
    """Mean next-token NLL (nats) of the windows through minivllm with `scheme` (None:
    unquantized; `lm_head`: on the LM head too) and a `kv_cache_dtype` cache (a prompt
    attends to its keys and values as the cache holds them, so a narrow cache's rounding
    is in the score)."""
    from minivllm import LLM, SamplingParams

    quant = {} if scheme is None else {"quantization": scheme}
    if scheme is not None and lm_head:
        targets = {"*": scheme, "lm_head": scheme}
        quant = {"quantization": "online", "quantization_config": {"targets": targets}}
    llm = LLM(
        model,
        max_model_len=WINDOW + 8,
        enable_prefix_caching=False,
        kv_cache_dtype=kv_cache_dtype,
        **quant,
    )
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=True)
    total, count = 0.0, 0
    for out in outs:
        for pos in range(1, len(out.prompt_token_ids)):
            total -= out.prompt_logprobs[pos][out.prompt_token_ids[pos]].logprob
            count += 1
    del llm
    return total / count


class _ReferenceLinear(torch.nn.Module):
    """A transformers Linear whose product is `scheme`'s reference on its quantized weight."""

    def __init__(self, linear: torch.nn.Linear, scheme: str) -> None:
        from minivllm.quantization import formats

        super().__init__()
        self.qw = formats.quantize(linear.weight.data, scheme)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from minivllm.quantization import formats

        return formats.reference_linear(x, self.qw, self.bias)


def _on_scheme_references(
    model: torch.nn.Module, scheme: str, lm_head: bool = False
) -> torch.nn.Module:
    """`model` with every linear layer but the LM head (`lm_head`: and it) on `scheme`'s
    reference, in place."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, torch.nn.Linear) and (lm_head or "lm_head" not in full):
                setattr(module, child_name, _ReferenceLinear(child, scheme))
    return model


@torch.no_grad()
def kl_to_bf16(
    model_dir: str, schemes: list[str], inputs: torch.Tensor, lm_head: bool = False
) -> dict[str, float]:
    """Mean KL(P_unquantized || P_scheme) per position over `inputs` [B, T], in float32;
    with `lm_head` also each scheme with the LM head on it, as "<scheme> + lm_head"."""
    from transformers import AutoModelForCausalLM

    def logprobs(model: torch.nn.Module) -> torch.Tensor:
        return torch.cat(
            [model(input_ids=b[None]).logits[0].float().log_softmax(-1) for b in inputs]
        )

    load = lambda: AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)  # noqa: E731
    base = logprobs(load().eval())
    out = {}
    for scheme in schemes:
        for head in (False, True) if lm_head else (False,):
            lq = logprobs(_on_scheme_references(load().eval(), scheme, head))
            out[_label(scheme, head)] = float((base.exp() * (base - lq)).sum(-1).mean())
    return out


def _label(scheme: str, lm_head: bool) -> str:
    return f"{scheme} + lm_head" if lm_head else scheme


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--heldout", required=True, help="heldout.txt of tools/prepare_corpus.py")
    parser.add_argument("--model", default="demo-base")
    parser.add_argument("--schemes", nargs="*", default=list(SCHEMES), choices=SCHEMES)
    parser.add_argument(
        "--kv-cache-dtypes",
        nargs="*",
        default=[],
        choices=[d for d in KV_CACHE_DTYPES if d != "auto"],
        help="also score the unquantized model with these KV-cache dtypes (perplexity only)",
    )
    parser.add_argument("--windows", type=int, help="score only the first N windows")
    parser.add_argument("--kl-windows", type=int, default=32, help="demo-base windows for KL")
    parser.add_argument("--kl-model", help="a second checkpoint for KL (e.g. the 0.6B shape)")
    parser.add_argument("--kl-tokens", type=int, default=4 * 128, help="its input: 4 x N/4 ids")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--lm-head", action="store_true", help="also each scheme with the LM head quantized"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from minivllm.kernels.isa import cpu_model, isa_summary
    from minivllm.loader.hub import resolve_model_path

    windows = heldout_windows(args.heldout, args.model, args.windows)
    print(f"{cpu_model()} [{isa_summary()}]; {args.model}: {len(windows)} windows of {WINDOW}")
    start = time.perf_counter()
    base = engine_nll(args.model, None, windows)
    heads = (False, True) if args.lm_head else (False,)
    nll = {
        _label(s, h): engine_nll(args.model, s, windows, lm_head=h)
        for s in args.schemes
        for h in heads
    }
    kv_nll = {d: engine_nll(args.model, None, windows, d) for d in args.kv_cache_dtypes}
    print(f"(engine runs: {time.perf_counter() - start:.0f} s)")

    kl_inputs = torch.tensor(windows[: args.kl_windows])
    kl = (
        kl_to_bf16(resolve_model_path(args.model), args.schemes, kl_inputs, args.lm_head)
        if args.schemes
        else {}
    )
    kl_big = {}
    if args.kl_model and args.schemes:
        with open(os.path.join(args.kl_model, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (4, args.kl_tokens // 4), generator=gen)
        kl_big = kl_to_bf16(args.kl_model, args.schemes, ids, args.lm_head)

    big = f" | KL, {os.path.basename(args.kl_model.rstrip('/'))}" if args.kl_model else ""
    print(f"| scheme | perplexity | vs unquantized | KL to unquantized (nats/token){big} |")
    print("|---|---|---|---|" + ("---|" if args.kl_model else ""))
    print(f"| unquantized | {math.exp(base):.3f} | | |" + (" |" if args.kl_model else ""))
    for s in nll:
        cells = [
            s,
            f"{math.exp(nll[s]):.3f}",
            f"{math.exp(nll[s] - base) - 1:+.2%}",
            f"{kl[s]:.5f}",
        ]
        if args.kl_model:
            cells.append(f"{kl_big[s]:.2e}")
        print("| " + " | ".join(cells) + " |")
    for d, value in kv_nll.items():
        cells = [f"unquantized, kv_cache_dtype={d}", f"{math.exp(value):.3f}"]
        cells += [f"{math.exp(value - base) - 1:+.2%}", ""] + ([""] if args.kl_model else [])
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
