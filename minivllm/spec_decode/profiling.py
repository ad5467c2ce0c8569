"""The target's step cost on this machine, for the adaptive verification planner."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from minivllm.distributed.parallel_state import broadcast_object
from minivllm.layers.attention.backend import build_common_metadata
from minivllm.layers.forward_context import ForwardContext, forward_context
from minivllm.spec_decode.adaptive import CostCurve

if TYPE_CHECKING:
    from minivllm.worker.model_runner import ModelRunner

logger = logging.getLogger("minivllm")


@torch.inference_mode()
def profile_step_cost(runner: ModelRunner) -> CostCurve:
    """Seconds per target step (forward and LM head) against its number of tokens, one
    token per request at the start of a sequence: medians of 3 after a warm-up, rank 0's
    figures on every rank. Sizes double up to the most a step can verify (<= 512)."""
    spec, sched = runner.config.speculative_config, runner.config.scheduler
    largest = min(
        sched.max_num_batched_tokens,
        sched.max_num_seqs * (1 + spec.num_speculative_tokens),
        512,
    )
    points, size = {}, 1
    while True:
        points[size] = _time_dummy_step(runner, size)
        if size >= largest:
            break
        size = min(2 * size, largest)
    curve = CostCurve.from_points(broadcast_object(points))
    logger.info(
        "adaptive verification: step cost %s",
        ", ".join(f"{n} tok {1e3 * t:.1f} ms" for n, t in zip(curve.sizes, curve.seconds)),
    )
    return curve


def _time_dummy_step(runner: ModelRunner, num_tokens: int) -> float:
    slots = [0] * num_tokens  # every row writes one slot of block 0: nothing reads it
    common = build_common_metadata(
        slots,
        list(range(num_tokens + 1)),
        [1] * num_tokens,
        [[0]] * num_tokens,
        runner.block_size,
        runner.device,
    )
    ids = torch.zeros(num_tokens, dtype=torch.long, device=runner.device)
    times = []
    for _ in range(4):
        start = time.perf_counter()
        with forward_context(
            ForwardContext((runner.attn_backend, runner.attn_backend.build_metadata(common)))
        ):
            hidden = runner.model(ids, ids)
        runner.model.compute_logits(hidden).float()
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[1]
