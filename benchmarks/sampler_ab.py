"""One sampling step, another commit's sampler against this one, in one process (same logits).

The other commit's package is imported as `minivllm_old`; make it once, e.g. for the
commit before the persistent input batch (issue 11):

    mkdir -p /tmp/oldpkg && git archive e164d32 minivllm | tar -x -C /tmp/oldpkg
    mv /tmp/oldpkg/minivllm /tmp/oldpkg/minivllm_old
    grep -rl minivllm /tmp/oldpkg/minivllm_old --include=*.py | xargs sed -i \\
        's/from minivllm\\./from minivllm_old./g; s/import minivllm\\./import minivllm_old./g'
    python benchmarks/sampler_ab.py --old /tmp/oldpkg

64 rows x 151,936, temperature 1, top-p 0.95, repetition/frequency/presence penalties,
each row with a 128-token prompt and 40 outputs; medians of 7, old and new alternating.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time

import torch

from minivllm.kernels.isa import cpu_model
from minivllm.layers.sampler import Sampler
from minivllm.sampling_params import SamplingParams
from minivllm.worker.input_batch import InputBatch
from minivllm.worker.request_state import CachedRequestState

ROWS, VOCAB = 64, 151936
PARAMS = SamplingParams(
    temperature=1.0,
    top_p=0.95,
    repetition_penalty=1.1,
    frequency_penalty=0.2,
    presence_penalty=0.1,
)


def make_state(cls: type, i: int):
    tokens = list(range(100, 228)) + list(range(i, i + 40))
    return cls(str(i), tokens, 128, PARAMS, [], 0, frozenset(), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", required=True, help="directory holding the minivllm_old package")
    args = parser.parse_args()
    sys.path.insert(0, args.old)
    old_sampler_mod = importlib.import_module("minivllm_old.layers.sampler")
    old_state_mod = importlib.import_module("minivllm_old.worker.request_state")
    torch.set_num_threads(2)

    old_states = [make_state(old_state_mod.CachedRequestState, i) for i in range(ROWS)]
    new_states = [make_state(CachedRequestState, i) for i in range(ROWS)]
    batch = InputBatch(256, VOCAB, "cpu")
    for state in new_states:
        batch.add(state)
    ids = [s.req_id for s in new_states]
    logits = (torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(0)) * 2).bfloat16()
    old = old_sampler_mod.Sampler(torch.Generator().manual_seed(1))
    new = Sampler(torch.Generator().manual_seed(1))

    def old_step() -> None:
        old(logits, old_state_mod.build_sampling_metadata(old_states, VOCAB, "cpu"))

    def new_step() -> None:
        new(logits, batch.sampling_metadata(ids))

    times: dict[str, list[float]] = {"old": [], "new": []}
    for _ in range(8):  # the first round warms up
        for name, step in (("old", old_step), ("new", new_step)):
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    t_old, t_new = (statistics.median(times[k][1:]) for k in ("old", "new"))
    print(
        f"{cpu_model()}: one sampling step, {ROWS} rows x {VOCAB}, T=1, top-p 0.95, "
        f"repetition/frequency/presence penalties: old {1e3 * t_old:.0f} ms, "
        f"new {1e3 * t_new:.0f} ms ({t_old / t_new:.2f}x), medians of 7, alternating"
    )


if __name__ == "__main__":
    main()
