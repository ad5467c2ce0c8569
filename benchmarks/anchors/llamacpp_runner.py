"""llama.cpp (llama-cpp-python's low-level API) on compare.py's workloads; prints `RESULT {json}`.

    DIR/venv-llama/bin/python benchmarks/anchors/llamacpp_runner.py --gguf M.gguf --threads 2 --reps 3

Run by benchmarks/compare.py --llamacpp-python/--llamacpp-gguf (not by CI).  The workload definitions,
prompts and timing come from compare.py itself (`_workloads`), so every engine is timed the same way.
Generation is our own loop over llama_decode: prompts go in whole (chunks of n_batch tokens, one
sequence id per prompt), then one token per sequence per step, greedy argmax over the logits in numpy,
EOS never checked.  One context per batch size (created before timing), KV cleared before each
generate.  --no-extra-bufts turns off ggml's extra weight buffers (AMX / CPU repack), as
`llama-bench --repack 0` does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import llama_cpp as L
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from compare import WORKLOADS, _workloads  # noqa: E402

N_BATCH = 2048


class Context:
    def __init__(self, model, n_seq: int, n_ctx: int, threads: int, n_vocab: int) -> None:
        p = L.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, N_BATCH, 512, n_seq
        p.n_threads = p.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(model, p)
        if not self.ctx:
            raise RuntimeError(f"llama_init_from_model failed (n_seq={n_seq}, n_ctx={n_ctx})")
        self.batch = L.llama_batch_init(N_BATCH, 0, 1)
        self.n_vocab = n_vocab

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> dict[int, int]:
        """items: (token, pos, seq, want_logits); returns {seq: argmax} for rows that want logits."""
        out: dict[int, int] = {}
        b = self.batch
        for start in range(0, len(items), N_BATCH):
            chunk = items[start : start + N_BATCH]
            for i, (tok, pos, seq, want) in enumerate(chunk):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, int(want)
                b.seq_id[i][0] = seq
            b.n_tokens = len(chunk)
            rc = L.llama_decode(self.ctx, b)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            for i, (_, _, seq, want) in enumerate(chunk):
                if want:
                    row = np.ctypeslib.as_array(
                        L.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,)
                    )
                    out[seq] = int(row.argmax())
        return out

    def generate(self, prompts: list[list[int]], new: int) -> list[list[int]]:
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        items = [(t, j, s, j == len(p) - 1) for s, p in enumerate(prompts) for j, t in enumerate(p)]
        nxt = self._decode(items)
        outs = [[nxt[s]] for s in range(len(prompts))]
        for step in range(1, new):
            items = [(outs[s][-1], len(p) + step - 1, s, True) for s, p in enumerate(prompts)]
            nxt = self._decode(items)
            for s in range(len(prompts)):
                outs[s].append(nxt[s])
        return outs


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--no-extra-bufts", action="store_true")
    a = ap.parse_args()

    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    if a.no_extra_bufts:
        mp.use_extra_bufts = False
    model = L.llama_model_load_from_file(a.gguf.encode(), mp)
    if not model:
        raise RuntimeError(f"cannot load {a.gguf}")
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    # one context per batch size, made before any timing; per-sequence room >= prompt + new tokens
    contexts = {1: Context(model, 1, 1024, a.threads, n_vocab)}
    if "batch16" in a.workloads:
        contexts[16] = Context(model, 16, 16 * 512, a.threads, n_vocab)
    if "batch64" in a.workloads:
        contexts[64] = Context(model, 64, 64 * 512, a.threads, n_vocab)

    def gen(prompts: list[list[int]], new: int) -> None:
        contexts[len(prompts)].generate(prompts, new)

    result = _workloads(gen, a.reps, a.workloads)
    print(
        "INFO "
        + json.dumps(
            {
                "llama_cpp_python": L.__version__,
                "gguf": os.path.basename(a.gguf),
                "extra_bufts": not a.no_extra_bufts,
            }
        ),
        flush=True,
    )
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
