"""A zero_copy engine's watch on its daemon: pid and start time polled from /proc.

On CPU the pages an engine maps outlive a dead daemon (the mapping holds the memfd), so
weights stay correct; the engine still stops, loudly, because from then on it holds
memory that nothing accounts for, and a restarted daemon would load a second copy
beside it. Every forward after the loss raises `WeightCacheDaemonLostError`.
"""

from __future__ import annotations

import logging
import threading
import weakref

from torch import nn

from minivllm.weight_cache.process import is_same_process_alive

logger = logging.getLogger("minivllm")
POLL_INTERVAL_S = 1.0


class WeightCacheDaemonLostError(RuntimeError):
    """The daemon whose memory this engine maps (zero_copy) has exited."""


class DaemonWatch:
    """Whether the daemon is alive; a daemon thread polls until the watched model is freed."""

    def __init__(self, pid: int, start_time: int, path: str) -> None:
        self.pid, self.start_time, self.path = pid, start_time, path
        self.lost = False

    def check(self) -> None:
        if self.lost or not is_same_process_alive(self.pid, self.start_time):
            self.lost = True
            raise WeightCacheDaemonLostError(
                f"the weight cache daemon (pid {self.pid}, {self.path}) whose memory this "
                "engine maps has exited; restart the engine (zero_copy needs a live daemon)"
            )

    def attach(self, model: nn.Module) -> None:
        """Fail every forward once the daemon is gone: a pre-hook on the input embeddings,
        which both the layer-by-layer and the fused decode step call first."""
        from minivllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding

        for module in model.modules():
            if isinstance(module, VocabParallelEmbedding) and not isinstance(
                module, ParallelLMHead
            ):
                module.register_forward_pre_hook(self._pre_forward)
        threading.Thread(
            target=_poll, args=(weakref.ref(self),), name="weight-cache-watch", daemon=True
        ).start()

    def _pre_forward(self, module: nn.Module, args: object) -> None:
        self.check()  # one /proc read a step (~20 us): a step never runs on a lost daemon


def _poll(ref: weakref.ref[DaemonWatch]) -> None:
    event = threading.Event()
    while not event.wait(POLL_INTERVAL_S):
        watch = ref()
        if watch is None:
            return
        try:
            watch.check()
        except WeightCacheDaemonLostError as e:
            logger.error("%s", e)
            return
        del watch
