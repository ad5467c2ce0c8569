"""Online quantization layer by layer, while the checkpoint streams in.

Quantizing only after the whole checkpoint is in holds every full-precision weight and the
quantized copies at once: the load's peak is the checkpoint plus its quantized form (an 8B
model in bf16, 16 GB, quantized to int8 peaks near 24 GB). Instead, each online-quantized
linear's full-precision weight sits on an anonymous mapping of its own, and the moment the
checkpoint has filled it (every shard of a fused qkv or gate_up) the layer is quantized and
processed for the engine's kernels, and the mapping is unmapped: the peak becomes the
quantized model plus about one layer's full-precision weight and the quantizer's bounded
temporaries (`formats.quantize` works in row chunks). vLLM does the same for its online
quantization (processing each layer once loaded, to cut the load's peak memory); the
processed layers are the ones `process_weights_after_loading` would have made.

Layers streamed: linears (the LM head too, where it is not tied to the embedding table)
whose method quantizes online, and MoE layers whose routed experts it quantizes (once
every expert's gate, up and down projections are in). The rest (checkpoint-quantized
layers, unquantized ones, a tied head) are processed at the end as before.
"""

from __future__ import annotations

from collections import Counter

from torch import nn

from minivllm.kernels.registry import Kernels
from minivllm.layers.embedding import ParallelLMHead
from minivllm.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear
from minivllm.layers.moe import FusedMoE
from minivllm.quantization.method import QuantizedLinearMethod
from minivllm.quantization.moe_method import QuantizedMoEMethod
from minivllm.utils import huge_pages
from minivllm.utils.memory import release_freed_host_memory

# Full-precision bytes processed between two trims of the heap. Quantizing a layer leaves
# its temporaries (the quantized rows before they move to huge pages, int4_w4a8's rows
# before they become panels) freed in the heap, which `keep_freed_host_memory`'s
# thresholds keep resident, and the next layers reuse only part of that room: at the
# Qwen3-4B shape 0.4-0.9 GB of freed pages had piled up by the end of the load, on top of
# the loaded engine. A trim costs ~5 ms here (and the pages it returns fault in again when
# reused), so it runs once per 256 MiB of checkpoint rather than once per layer.
TRIM_EVERY_BYTES = 256 << 20


def streamable(module: nn.Module, shared: set[int]) -> bool:
    """A linear whose weight online quantization replaces, held by no other module."""
    method = getattr(module, "quant_method", None)
    return (
        isinstance(module, (LinearBase, ParallelLMHead))
        and type(method) is QuantizedLinearMethod
        and method.source == "online"
        and id(module.weight) not in shared
        and module.weight.device.type == "cpu"
    )


def streamable_experts(module: nn.Module) -> bool:
    """A MoE layer whose routed experts online quantization replaces."""
    method = getattr(module, "quant_method", None)
    return (
        isinstance(module, FusedMoE)
        and type(method) is QuantizedMoEMethod
        and method.source == "online"
        and module.w13.device.type == "cpu"
    )


def _shards(module: nn.Module) -> set[object]:
    """The shard ids the checkpoint fills the weight by (a fused layer's parts)."""
    if isinstance(module, QKVParallelLinear):
        return {"q", "k", "v"}
    if isinstance(module, MergedColumnParallelLinear):
        return set(range(len(module.output_sizes)))
    return {None}


_TWICE = (
    "the checkpoint holds this weight again after the layer was complete and quantized "
    "(a duplicate tensor in the checkpoint)"
)


class _StreamedLoader:
    """Stands in for a streamed weight's `weight_loader`: loads, and processes the layer
    once every shard is in."""

    def __init__(self, name: str, module: nn.Module, streaming: StreamedQuantization) -> None:
        self.name, self.module = name, module
        self.param = module.weight  # the layer drops it while processing
        self.loader = module.weight.weight_loader
        self.pending = _shards(module)
        self.streaming = streaming

    def __call__(self, param: nn.Parameter, loaded, shard_id: object = None) -> None:
        if not self.pending:
            raise ValueError(f"{self.name}: {_TWICE}")
        self.loader(param, loaded, shard_id)  # a fused layer's refuses shard None
        self.pending.discard(shard_id)
        if not self.pending:
            self.streaming.process(self.module, param)


class _StreamedExperts:
    """Stands in for a MoE layer's `load_expert_weight`: loads, and quantizes the layer's
    experts once every expert's three projections are in."""

    def __init__(self, name: str, module: nn.Module, streaming: StreamedQuantization) -> None:
        self.name, self.module = name, module
        self.loader = module.load_expert_weight
        self.pending = {
            (e, p) for e in range(module.num_experts) for p in ("gate_proj", "up_proj", "down_proj")
        }
        self.streaming = streaming

    def __call__(self, expert: int, proj: str, loaded) -> None:
        if not self.pending:
            raise ValueError(f"{self.name}, expert {expert} {proj}: {_TWICE}")
        self.loader(expert, proj, loaded)
        self.pending.discard((expert, proj))
        if not self.pending:
            self.streaming.process_experts(self.module)


class StreamedQuantization:
    """Installed on a built model before `load_weights`. The layers it processed are left
    alone by `process_weights_after_loading` (their methods know they are processed);
    `arena_mark` is the huge-page arena's count before them, for the load's log line."""

    def __init__(self, model: nn.Module, kernels: Kernels) -> None:
        self.kernels = kernels
        arena = huge_pages.weights_arena()
        # what the arena held before: the load's log line counts the streamed layers too
        self.arena_mark = (arena.bytes_placed, arena.seconds)
        counts = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
        shared = {i for i, n in counts.items() if n > 1}
        modules = list(model.named_modules())
        self.loaders = [_StreamedLoader(n, m, self) for n, m in modules if streamable(m, shared)]
        for loader in self.loaders:
            loader.module.weight.weight_loader = loader
        self.experts = [_StreamedExperts(n, m, self) for n, m in modules if streamable_experts(m)]
        for experts in self.experts:
            experts.module.load_expert_weight = experts
        self.untrimmed = 0  # full-precision bytes processed since the heap's last trim

    def finish(self) -> None:
        """Put the layers' own loaders back once the checkpoint is in (a layer the
        checkpoint never completed is then processed with the rest, or named missing),
        so that no loader keeps its module in a reference cycle."""
        for loader in self.loaders:
            loader.param.weight_loader = loader.loader
        for experts in self.experts:
            del experts.module.load_expert_weight  # the class's method again
        self.loaders, self.experts = [], []

    def process(self, module: nn.Module, param: nn.Parameter) -> None:
        module.quant_method.process_weights_after_loading(module, self.kernels)
        self.processed(param.nbytes)
        param.data = param.data.new_empty(0)  # unmaps the full-precision copy now

    def process_experts(self, module: nn.Module) -> None:
        full = [module.w13, module.w2]
        module.quant_method.process_weights_after_loading(module, self.kernels)
        self.processed(sum(param.nbytes for param in full))
        for param in full:  # whoever else holds them, the stacks go now
            param.data = param.data.new_empty(0)

    def processed(self, nbytes: int) -> None:
        self.untrimmed += nbytes
        if self.untrimmed >= TRIM_EVERY_BYTES:
            release_freed_host_memory()
            self.untrimmed = 0
