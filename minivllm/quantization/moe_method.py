"""Quantized routed experts: a MoE layer's stacked `w13` and `w2` in one of the schemes.

vLLM's targeted online quantization covers linear layers and routed experts (PR #51285),
and its `--quantization fp8` quantizes a MoE model's experts as well as its linears; so
do our shorthands and targets (`quantization/apply.py` matches the FusedMoE module's
name, e.g. `model.layers.3.mlp.experts`, or every expert's checkpoint names).

Layout. Every scheme's scales are per output row (per row and group of k for int4 and
block-scaled fp8), so quantizing the stack [E, rows, k] as one matrix [E * rows, k]
gives each expert exactly what quantizing it alone would. The layer holds two
`formats.QuantWeights`, registered as `w13_weight`, `w13_scale`, ... (`w2_...`), the
names the weight cache maps; expert e's part is a view of rows [e * rows, (e + 1) * rows),
contiguous, which the linear ops take as they take a layer's own tensors.

Compute. `layers/moe.routed_experts`' loop, each expert's two products by a
`QuantizedLinearMethod` holding that expert's views: the same op choice (our AVX2 or
bf16 kernel, or the plain-PyTorch reference), `linear_backend_per_quant` and the log as
the linear layers. A token batch reads each chosen expert's rows once. Where the kernels
run, the same loop runs in one compiled call per layer on the stacks: `moe_quantw` in
fp32 engines (AVX2), `moe_quant_experts` in bf16 engines (AVX512-BF16), the latter bit
for bit the loop's numbers (the Python loop's per-expert indexing and scattering cost
more than the int8 and int4 products saved at decode).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch
from torch import nn

from minivllm.kernels.registry import Kernels
from minivllm.layers.moe import routed_experts
from minivllm.quantization import formats, kernel_limits
from minivllm.quantization.config import SchemeSpec
from minivllm.quantization.method import QuantizedLinearMethod, processed_shapes
from minivllm.utils import huge_pages

logger = logging.getLogger("minivllm")

PARTS = ("w13", "w2")
# schemes whose VNNI panels may replace the stacked rows (`_build_stacks`, `_settle_rows`)
PANEL_ROW_SCHEMES = ("int4_w4a8", "int8_w8a8")


class QuantizedMoEMethod:
    """One scheme for one FusedMoE layer's routed experts; `backend` None picks the op."""

    supports_mapped_weights = True

    def __init__(self, spec: SchemeSpec, backend: str | None = None, source: str = "online"):
        self.spec = spec
        self.requested_backend = backend
        self.source = source
        self.dtype = torch.get_default_dtype()  # the model's
        self.prefix = "routed experts"  # the layer's module name, for errors (apply.py sets it)
        self.experts: dict[str, list[QuantizedLinearMethod]] = {p: [] for p in PARTS}
        # the whole layer in one call on the stacks: fp32 engines on the AVX2 family
        # (avx2_moe.cpp's moe_quantw), bf16 engines on the AVX512-BF16 one
        # (moe_quant.cpp's moe_quant_experts: int8_w8a8 at any step, with each expert's
        # prepacked copy past `kernel_rows` (every step on VNNI panels, which then replace
        # the stacked rows); int4_w4a8 at any step on each expert's panels, which replace
        # the rows, as its dense layers' do; the weight-only schemes at steps of up to
        # `kernel_rows` tokens, past which an expert runs `QuantizedLinearMethod.apply` in
        # the loop, as its dense layers would); None: the routing loop in Python, an op
        # per expert
        self.moe_op = None
        self.bf16_moe_op = None
        self.kernel_rows = 0
        self.packed: dict[str, list[torch.Tensor]] = {p: [] for p in PARTS}
        self.stacked: dict[str, formats.QuantWeights] = {}

    @property
    def group(self) -> int:
        """k per scale column: int4's group, else 0 (per channel)."""
        return self.spec.group_size if self.spec.scheme in formats.INT4_SCHEMES else 0

    def shapes(self, layer: nn.Module) -> dict[str, tuple[int, int]]:
        """Each stacked part as one matrix: [E * rows, k]."""
        e, hidden, inter = layer.num_experts, layer.hidden_size, layer.intermediate
        return {"w13": (e * 2 * inter, hidden), "w2": (e * hidden, inter)}

    def check_shape(self, layer: nn.Module, name: str) -> None:
        """Refuse, before anything loads, groups that do not divide the experts' inputs."""
        self.prefix = name
        group = self.group
        for part, (_, k) in self.shapes(layer).items():
            if group and k % group:
                hint = " (a smaller tensor_parallel_size may)" if layer.tp_size > 1 else ""
                what = "down_proj's" if part == "w2" else "gate_proj's and up_proj's"
                raise ValueError(
                    f"{name}: groups of {group} k do not divide the routed experts' "
                    f"{what} {k} input features on this rank{hint}; "
                    + (
                        "pass a group_size that does (quantization_config={'group_size': ...})"
                        if self.source == "online"
                        else "the checkpoint's scales cannot be split that way"
                    )
                )

    def process_weights_after_loading(self, layer: nn.Module, kernels: Kernels) -> None:
        """Quantize one expert at a time into the stacks' final tensors: every scale is per
        row, so the result is the whole stack's, without its float32 temporaries."""
        if self.stacked:  # processed already, as the checkpoint streamed
            return
        spec, kernel = self.spec, kernels.op("quantize_weight")
        for part, (n, k) in self.shapes(layer).items():
            full = getattr(layer, part).data
            stacks = self._build_stacks(
                layer.num_experts,
                n,
                k,
                full.device,
                lambda e, w=full: formats.quantize(
                    w[e], spec.scheme, spec.group_size, spec.symmetric, kernel=kernel
                ),
            )
            delattr(layer, part)
            self._register(layer, part, stacks)
        self._use(layer, kernels, built=True)

    def _build_stacks(
        self,
        num_experts: int,
        n: int,
        k: int,
        device: torch.device,
        expert: Callable[[int], formats.QuantWeights],
    ) -> dict[str, torch.Tensor]:
        """The processed tensors of an [n, k] stack (on huge pages on CPU, but for rows
        that VNNI panels may replace: `_settle_rows`), filled one expert at a time from
        `expert(e)`, that expert's rows as the scheme's tensors."""
        arena = huge_pages.weights_arena()
        # rows the panels may replace stay in plain memory (`_settle_rows` moves them once
        # they stay): dropped from the arena, they would pin its chunks
        plain = {"weight"} if self.spec.scheme in PANEL_ROW_SCHEMES else set()
        stacks = {
            name: torch.empty(shape, dtype=dtype, device=device)
            if name in plain
            else arena.empty(shape, dtype, device)
            for name, (shape, dtype) in processed_shapes(self.spec, n, k, self.group).items()
        }
        rows = n // num_experts
        for e in range(num_experts):
            for name, tensor in expert(e).tensors().items():
                stacks[name][e * rows : (e + 1) * rows].copy_(tensor)
        return stacks

    def _register(self, layer: nn.Module, part: str, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            param = nn.Parameter(tensor, requires_grad=False)
            layer.register_parameter(f"{part}_{name}", param)

    def prepare_for_mapping(self, layer: nn.Module) -> None:
        """Empty parameters of the processed shapes, for the weight cache to map its own."""
        for part, (n, k) in self.shapes(layer).items():
            if hasattr(layer, part):
                delattr(layer, part)
            for name, (shape, dtype) in processed_shapes(self.spec, n, k, self.group).items():
                param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
                layer.register_parameter(f"{part}_{name}", param)

    def process_weights_after_mapping(self, layer: nn.Module, kernels: Kernels) -> None:
        self._use(layer, kernels, built=False)

    def _use(self, layer: nn.Module, kernels: Kernels, built: bool) -> None:
        """One QuantizedLinearMethod per expert and part, on views of the stacked rows."""
        group = self.group
        for part, (n, k) in self.shapes(layer).items():
            prefix = f"{part}_"
            tensors = {
                name[len(prefix) :]: p.data
                for name, p in layer.named_parameters(recurse=False)
                if name.startswith(prefix)
            }
            stacked = formats.QuantWeights.from_tensors(tensors, self.spec.scheme, group, n, k)
            rows = n // layer.num_experts
            mapped = layer._buffers.get(f"{part}_packed")  # the weight cache's, if it has one
            if mapped is not None and mapped.shape[0] != layer.num_experts:
                mapped = None
            self.experts[part] = []
            for e in range(layer.num_experts):
                cut = slice(e * rows, (e + 1) * rows)
                view = dataclasses.replace(
                    stacked,
                    **{name: t[cut] for name, t in stacked.tensors().items()},
                    out_features=rows,
                )
                method = QuantizedLinearMethod(self.spec, self.requested_backend, self.source)
                method.dtype = self.dtype
                # fp32 engines: the experts' one call reads their stacked rows
                method.use(view, kernels, None if mapped is None else mapped[e], False, False)
                self.experts[part].append(method)
            self.stacked[part] = stacked
            self._stack_packed(layer, part, mapped)
            # rows `_build_stacks` left in plain memory (mapped ones stay where they are)
            plain = built and self.spec.scheme in PANEL_ROW_SCHEMES
            self._settle_rows(layer, part, plain)
        first = self.experts["w13"][0]
        self.moe_op = kernels.op("moe_quantw") if first.fp32_op is not None else None
        # every product on the bf16 quant_linear (a down projection whose K, the rank's
        # expert intermediate size, is no multiple of 32 runs the reference: the loop then)
        bf16 = all(self.experts[part][0].op is not None for part in PARTS)
        self.bf16_moe_op = kernels.op("moe_quant_experts") if bf16 else None
        # the scheme's, the same for every expert; the loop's experts take it too, so that
        # the loop computes what the one call does (int4: exact products up to 8 rows);
        # where there is no one call (a part without the bf16 kernel) each keeps its own
        # (a rowless part's is 0: its panels take every batch)
        self.kernel_rows = kernel_limits.moe_one_call_rows(first.quant_weights)
        for part in PARTS if bf16 else ():
            for method in self.experts[part]:
                if self.kernel_rows and not method.quant_weights.has_rows:
                    raise RuntimeError(f"{self.prefix}: experts dropped rows their one call reads")
                method.kernel_rows = self.kernel_rows
        # the prepacked copies, one per expert, for the one call: int8_w8a8's past
        # kernel_rows, int4_w4a8's panels at every step (int4_w4a8.cpp's GEMM); the
        # weight-only schemes have none
        for part in PARTS:
            copies = [m.quant_weights.packed for m in self.experts[part]]
            self.packed[part] = copies if bf16 and None not in copies else []

    def _settle_rows(self, layer: nn.Module, part: str, plain: bool) -> None:
        """Make the stacked rows of `part` what the experts kept (alike, one scheme and
        backend): none where they dropped their row copies (int4_w4a8, and int8_w8a8 on
        VNNI panels: `{part}_weight` becomes [n, 0]); the experts' rows as one stack on huge pages
        where the stack came without them (mapped rowless from the weight cache by an
        engine that reads rows) or was built in plain memory (`_build_stacks`)."""
        methods, stacked = self.experts[part], self.stacked[part]
        if not methods[0].quant_weights.has_rows:
            rows = torch.empty(stacked.out_features, 0, dtype=stacked.weight.dtype)
        elif not stacked.has_rows or plain:
            rows = (
                stacked.weight
                if stacked.has_rows
                else torch.cat([m.quant_weights.weight for m in methods])
            )
            rows = huge_pages.weights_arena().copy(rows)
            cut = rows.shape[0] // len(methods)
            for e, method in enumerate(methods):
                qw = method.quant_weights
                method.quant_weights = dataclasses.replace(qw, weight=rows[e * cut : (e + 1) * cut])
        else:
            return
        self.stacked[part] = dataclasses.replace(stacked, weight=rows)
        layer.register_parameter(f"{part}_weight", nn.Parameter(rows, requires_grad=False))

    # the experts' prepacked copies, stacked, where the weight cache holds them
    optional_mapped_buffers = tuple(f"{part}_packed" for part in PARTS)

    def _stack_packed(self, layer: nn.Module, part: str, mapped: torch.Tensor | None) -> None:
        """The experts' prepacked copies of `part` as one stack [E, ...] on huge pages, the
        layer's buffer `{part}_packed` (so a weight cache daemon holds it and mapping
        engines take it: `mapped`, where every expert took its slice), each expert's copy a
        view of it; no buffer where the experts have no copies."""
        methods = self.experts[part]
        copies = [m.quant_weights.packed for m in methods]
        if None in copies:
            layer._buffers.pop(f"{part}_packed", None)
            return
        taken = mapped is not None and all(
            c.data_ptr() == mapped[e].data_ptr() for e, c in enumerate(copies)
        )
        stack = (
            mapped
            if taken
            else huge_pages.weights_arena().empty(
                (len(copies), *copies[0].shape), copies[0].dtype, copies[0].device
            )
        )
        for e, method in enumerate(methods):
            if not taken:
                stack[e].copy_(copies[e])
            method.quant_weights.packed = stack[e]
        layer.register_buffer(f"{part}_packed", stack, persistent=False)

    @property
    def op_name(self) -> str:
        if self.moe_op is not None:
            return "cpu_kernel (the AVX2 family's moe_quantw, float32 activations)"
        if self.bf16_moe_op is not None:
            return "cpu_kernel (moe_quant_experts, bfloat16 activations)"
        return self.experts["w13"][0].op_name if self.experts["w13"] else "not processed"

    @property
    def quant_weights(self) -> formats.QuantWeights | None:
        """Expert 0's w13 (what the backend log describes); None before processing."""
        return self.experts["w13"][0].quant_weights if self.experts["w13"] else None

    @property
    def kernel_op(self):
        return self.experts["w13"][0].kernel_op if self.experts["w13"] else None

    def apply(
        self, layer: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        if self.moe_op is not None and x.dtype == torch.float32:
            a, b = self.stacked["w13"], self.stacked["w2"]
            return self.moe_op(
                x, weights, ids, layer.num_experts, a.kind, a.group_size,
                a.weight, a.scale, a.zero, b.weight, b.scale, b.zero,
            )  # fmt: skip
        if (
            self.bf16_moe_op is not None
            and x.dtype == torch.bfloat16
            and (x.shape[0] <= self.kernel_rows or self.packed["w13"])
        ):
            a, b = self.stacked["w13"], self.stacked["w2"]
            return self.bf16_moe_op(
                x, weights, ids, layer.num_experts, a.kind, a.group_size,
                a.weight, a.scale, a.zero, a.wsum, b.weight, b.scale, b.zero, b.wsum,
                self.packed["w13"], self.packed["w2"], self.kernel_rows,
            )  # fmt: skip
        w13, w2 = self.experts["w13"], self.experts["w2"]
        return routed_experts(
            x,
            weights,
            ids,
            lambda e, rows: w13[e].apply(layer, rows, None),
            lambda e, h: w2[e].apply(layer, h, None),
        )
