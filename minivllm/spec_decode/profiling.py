"""The target's step cost on this machine, for the adaptive verification planner."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from minivllm.distributed.parallel_state import broadcast_object
from minivllm.layers.attention.backend import build_common_metadata
from minivllm.spec_decode.adaptive import CostCurve

if TYPE_CHECKING:
    from minivllm.worker.model_runner import ModelRunner

logger = logging.getLogger("minivllm")


@torch.inference_mode()
def profile_step_cost(runner: ModelRunner, num_blocks: int) -> CostCurve:
    """Seconds per target step (forward, LM head, greedy pick) against its number of
    tokens, one token per request and one token of context: medians of 3 after a
    warm-up, through the runner's own forward path, rank 0's figures on every rank. Sizes
    double up to the most a step can verify (<= 512). Then the same largest step with
    every row at a long context prices attention per (token, context token) pair: a
    verification's rows attend to their whole sequence, and at a few hundred tokens of
    context that is a fifth of a 0.6B model's step (measured: 80 rows at ~190 tokens
    cost 294 ms where the one-token profile said 231)."""
    spec, sched = runner.config.speculative_config, runner.config.scheduler
    largest = min(
        sched.max_num_batched_tokens,
        sched.max_num_seqs * (1 + spec.num_speculative_tokens),
        512,
    )
    points, size = {}, 1
    while True:
        points[size] = _time_dummy_step(runner, size, 1, num_blocks)
        if size >= largest:
            break
        size = min(2 * size, largest)
    # rows at a long context: all read the same blocks (block tables may share them)
    context = min(sched.max_model_len, num_blocks * runner.block_size, 512)
    extra = (
        _time_dummy_step(runner, largest, context, num_blocks) - points[largest]
        if context > 1
        else 0.0
    )
    per_pair = max(extra, 0.0) / (largest * max(context - 1, 1))
    points, per_pair = broadcast_object((points, per_pair))
    curve = CostCurve.from_points(points, per_pair)
    logger.info(
        "adaptive verification: step cost %s; attention %.3f us per (token, context token)",
        ", ".join(f"{n} tok {1e3 * t:.1f} ms" for n, t in zip(curve.sizes, curve.seconds)),
        1e6 * per_pair,
    )
    return curve


def _time_dummy_step(runner: ModelRunner, num_tokens: int, context: int, num_blocks: int) -> float:
    """Every row is the last token of a `context`-token sequence held in blocks 0, 1, ...;
    each writes its key and value to a slot of its own (the KV writes split rows across
    threads, so slots must differ, as the scheduler's do). What the rows read back is
    garbage either way: nothing any request owns yet, as this runs before the first step."""
    size = runner.block_size
    blocks = list(range(-(-context // size)))
    num_slots = num_blocks * size
    common = build_common_metadata(
        [i % num_slots for i in range(num_tokens)],
        list(range(num_tokens + 1)),
        [context] * num_tokens,
        [blocks] * num_tokens,
        size,
        runner.device,
    )
    ids = torch.zeros(num_tokens, dtype=torch.long, device=runner.device)
    positions = torch.full((num_tokens,), context - 1, dtype=torch.long, device=runner.device)
    times = []
    for _ in range(4):
        start = time.perf_counter()
        hidden = runner.forward(ids, positions, runner.attn_backend.build_metadata(common))
        runner.model.compute_logits(hidden).float().argmax(dim=-1)
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[1]
