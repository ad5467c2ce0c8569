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
from minivllm.quantization import formats
from minivllm.quantization.config import SchemeSpec
from minivllm.quantization.method import QuantizedLinearMethod, processed_shapes
from minivllm.utils import huge_pages

logger = logging.getLogger("minivllm")

PARTS = ("w13", "w2")


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
        # prepacked copy past `kernel_rows`; int4_w4a8 at any step on each expert's
        # panels, a copy of its int4 weights beside the stack, as its dense layers hold
        # one; the weight-only schemes at steps of up to
        # `kernel_rows` tokens, past which an expert runs `QuantizedLinearMethod.apply` in
        # the loop, as its dense layers would); None: the routing loop in Python, an op
        # per expert
        self.moe_op = None
        self.bf16_moe_op = None
        self.kernel_rows = 0
        self.packed: dict[str, list[torch.Tensor]] = {p: [] for p in PARTS}
        self.stacked: dict[str, formats.QuantWeights] = {}
        self._plain_rows: set[str] = set()  # parts whose rows `_build_stacks` kept off huge pages

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
        spec = self.spec
        for part, (n, k) in self.shapes(layer).items():
            full = getattr(layer, part).data
            stacks = self._build_stacks(
                part,
                layer.num_experts,
                n,
                k,
                full.device,
                lambda e, w=full: formats.quantize(
                    w[e], spec.scheme, spec.group_size, spec.symmetric
                ),
            )
            delattr(layer, part)
            self._register(layer, part, stacks)
        self._use(layer, kernels)

    def _build_stacks(
        self,
        part: str,
        num_experts: int,
        n: int,
        k: int,
        device: torch.device,
        expert: Callable[[int], formats.QuantWeights],
    ) -> dict[str, torch.Tensor]:
        """The processed tensors of `part`'s [n, k] stack (on huge pages on CPU), filled
        one expert at a time from `expert(e)`, that expert's rows as the scheme's tensors."""
        arena = huge_pages.weights_arena()
        shapes = processed_shapes(self.spec, n, k, self.group)
        stacks = {
            name: arena.empty(shape, dtype, device) for name, (shape, dtype) in shapes.items()
        }
        if self.spec.scheme == "int4_w4a8":
            # rows its panels may replace (`_settle_rows` moves them once they stay): in
            # the arena they would pin its chunks after being dropped
            shape, dtype = shapes["weight"]
            stacks["weight"] = torch.empty(shape, dtype=dtype, device=device)
            self._plain_rows.add(part)
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
        self._use(layer, kernels)

    def _use(self, layer: nn.Module, kernels: Kernels) -> None:
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
                method.use(view, kernels, None if mapped is None else mapped[e], False)
                self.experts[part].append(method)
            self.stacked[part] = stacked
            self._stack_packed(layer, part, mapped)
            self._settle_rows(layer, part)
        first = self.experts["w13"][0]
        self.moe_op = kernels.op("moe_quantw") if first.fp32_op is not None else None
        # every product on the bf16 quant_linear (a down projection whose K, the rank's
        # expert intermediate size, is no multiple of 32 runs the reference: the loop then)
        bf16 = all(self.experts[part][0].op is not None for part in PARTS)
        self.bf16_moe_op = kernels.op("moe_quant_experts") if bf16 else None
        # the scheme's, the same for every expert; the loop's experts take it too, so that
        # the loop computes what the one call does (int4: exact products up to 8 rows)
        self.kernel_rows = formats.moe_one_call_rows(first.quant_weights)
        for part in PARTS:
            for method in self.experts[part]:
                method.kernel_rows = self.kernel_rows
        # the prepacked copies, one per expert, for the one call: int8_w8a8's past
        # kernel_rows, int4_w4a8's panels at every step (int4_w4a8.cpp's GEMM); the
        # weight-only schemes have none
        for part in PARTS:
            copies = [m.quant_weights.packed for m in self.experts[part]]
            self.packed[part] = copies if bf16 and None not in copies else []

    def _settle_rows(self, layer: nn.Module, part: str) -> None:
        """Make the stacked rows of `part` what the experts kept (alike, one scheme and
        backend): none where they dropped their row copies (int4_w4a8 on its panels:
        `{part}_weight` becomes [n, 0]); the experts' rows as one stack on huge pages
        where the stack came without them (mapped rowless from the weight cache by an
        engine that reads rows) or was built in plain memory (`_build_stacks`)."""
        methods, stacked = self.experts[part], self.stacked[part]
        plain = part in self._plain_rows
        self._plain_rows.discard(part)
        if not methods[0].quant_weights.has_rows:
            rows = torch.empty(stacked.out_features, 0, dtype=torch.uint8)
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


class CheckpointMoEMethod(QuantizedMoEMethod):
    """Routed experts the checkpoint stores quantized, one tensor per expert and projection
    (`experts.7.up_proj.weight`, `...weight_scale_inv`): DeepSeek's fp8 releases
    (transformers' fp8 format, 128 x 128 block scales) and compressed-tensors checkpoints
    (int8 per channel, int4 groups packed or not, fp8 per channel, tensor or block).

    The model's loader hands each expert tensor to `load_expert_tensor`, which brings it
    to rows (a per-tensor or block scale repeated down the rows, packed words unpacked),
    cuts this rank's part (gate and up: rows of the intermediate dimension; down: its
    columns, and their groups), and writes it into a stack [E, rows, k] (int4 values
    unpacked to a byte each until the end of loading). After loading, each expert becomes
    the scheme's tensors as `formats.from_*_values` build them for a pre-quantized linear
    (the checkpoint's values and scales, never re-quantized), written into the final
    stacks one expert at a time."""

    def __init__(self, stored, backend: str | None = None) -> None:
        super().__init__(stored.spec, backend, stored.format)
        self.stored = stored
        self.block = stored.block
        self.device = torch.device("cpu")
        self._stacks: dict[str, dict[str, torch.Tensor]] = {}
        self._seen: set[tuple[str, int, str, str]] = set()

    @property
    def group(self) -> int:
        """k per scale column: int4's group, block fp8's block k, else 0 (per channel)."""
        if self.block is not None:
            return self.block[1]
        return super().group

    @property
    def asymmetric(self) -> bool:
        return self.spec.scheme in formats.INT4_SCHEMES and not self.spec.symmetric

    @property
    def bits(self) -> int:
        return 4 if self.spec.scheme in formats.INT4_SCHEMES else 8

    def checkpoint_suffix(self, key: str) -> str:
        """The checkpoint's name for a stack: its values, scale or zero point."""
        if key == "values":
            return "weight_packed" if self.stored.format == "pack-quantized" else "weight"
        return self.stored.scale_name if key == "scale" else "weight_zero_point"

    def create_weights(self, layer: nn.Module, name: str) -> None:
        """Drop w13 and w2: the checkpoint format's stacks replace them as tensors arrive
        (`_stack`; never allocated where the weight cache maps the processed tensors)."""
        self.check_shape(layer, name)
        self.device = layer.w13.device
        for part in PARTS:
            delattr(layer, part)

    def _stack(self, layer: nn.Module, part: str) -> dict[str, torch.Tensor]:
        """The part's values [E, rows, k], scales [E, rows, k / group or 1] (NaN until
        loaded) and int4 zero points, allocated at its first tensor."""
        if part not in self._stacks:
            n, k = self.shapes(layer)[part]
            e, group = layer.num_experts, self.group
            integer = self.spec.scheme != "fp8_w8a16"
            cols = k // group if group else 1
            options = dict(device=self.device)
            self._stacks[part] = {
                "values": torch.zeros(
                    e, n // e, k, dtype=torch.int8 if integer else torch.uint8, **options
                ),
                "scale": torch.full((e, n // e, cols), float("nan"), **options),
            }
            if self.asymmetric:
                self._stacks[part]["zero"] = torch.zeros(
                    e, n // e, cols, dtype=torch.int8, **options
                )
        return self._stacks[part]

    def load_expert_tensor(
        self, layer: nn.Module, name: str, expert: int, proj: str, suffix: str, tensor
    ) -> None:
        """Checkpoint tensor `name`: expert `expert`'s `proj` (gate_proj, up_proj,
        down_proj) `suffix` (weight, weight_packed, weight_scale, ...)."""
        from minivllm.quantization.ct_method import _scale_values, unpack_int32

        part = "w2" if proj == "down_proj" else "w13"
        inter, hidden = layer.intermediate * layer.tp_size, layer.hidden_size
        full_rows, full_k = (hidden, inter) if part == "w2" else (inter, hidden)
        group = self.group
        if suffix in ("input_scale", "activation_scale"):
            return  # static activation scales: read, not used (weight-only)
        if suffix == "weight_shape":
            if tensor.tolist() != [full_rows, full_k]:
                raise ValueError(
                    f"{name} is {tensor.tolist()}; the model's expert {proj} is "
                    f"[{full_rows}, {full_k}]"
                )
            return
        if suffix == self.checkpoint_suffix("values"):
            key = "values"
            if tensor.dtype == torch.int32 and self.stored.format == "pack-quantized":
                words = -(-full_k * self.bits // 32)
                _expect_shape(name, tensor, (full_rows, words))
                tensor = unpack_int32(tensor, self.bits, full_k)
            elif tensor.dtype == torch.float8_e4m3fn and self.spec.scheme == "fp8_w8a16":
                tensor = tensor.view(torch.uint8)
            elif tensor.dtype != self._stack(layer, part)["values"].dtype:
                want = "float8_e4m3fn" if self.spec.scheme == "fp8_w8a16" else "int8"
                raise ValueError(
                    f"{name} is {tensor.dtype}; the checkpoint's {self.stored} stores {want}"
                )
            value = tensor
        elif suffix == self.stored.scale_name or (
            # a per-tensor fp8 scale goes by either name (vLLM's and transformers')
            self.stored.per_tensor and suffix in ("weight_scale", "weight_scale_inv")
        ):
            key, value = "scale", _scale_values(tensor)
            if self.stored.per_tensor:
                if value.numel() != 1:
                    raise ValueError(
                        f"{name}: a per-tensor scale holds one value, got {tuple(value.shape)}"
                    )
                value = value.reshape(1, 1).expand(full_rows, 1)
            elif self.block is not None:
                rows, cols = self.block
                expected = (-(-full_rows // rows), -(-full_k // cols))
                if tuple(value.shape) != expected:
                    raise ValueError(
                        f"{name}: block scales of a [{full_rows}, {full_k}] weight in {rows} x "
                        f"{cols} blocks have shape {list(expected)}, got {list(value.shape)}"
                    )
                value = value.repeat_interleave(rows, dim=0)[:full_rows]
        elif suffix == "weight_zero_point" and self.asymmetric:
            key = "zero"
            if tensor.dtype not in (torch.int8, torch.int32):
                raise ValueError(f"{name} is {tensor.dtype}; zero points are int8 or packed int32")
            if tensor.dtype == torch.int32:  # packed down the rows
                _expect_shape(name, tensor, (-(-full_rows * self.bits // 32), full_k // group))
                tensor = unpack_int32(tensor.t().contiguous(), self.bits, full_rows)
                tensor = tensor.t().contiguous()
            value = tensor
        else:
            raise ValueError(f"unexpected routed-expert tensor {name} for {self.stored}")
        columns = full_k if key == "values" else (full_k // group if group else 1)
        _expect_shape(name, value, (full_rows, columns))
        stack = self._stack(layer, part)
        size, start = layer.intermediate, layer.tp_rank * layer.intermediate
        if part == "w2":  # this rank's columns of k (and their groups; a per-row scale whole)
            if key == "values":
                value = value.narrow(1, start, size)
            elif group:
                value = value.narrow(1, start // group, size // group)
            stack[key][expert].copy_(value)
        else:
            offset = 0 if proj == "gate_proj" else size
            stack[key][expert, offset : offset + size].copy_(value.narrow(0, start, size))
        self._seen.add((part, expert, proj, key))

    def process_weights_after_loading(self, layer: nn.Module, kernels: Kernels) -> None:
        keys = ["values", "scale", *(["zero"] if self.asymmetric else [])]
        missing = [
            f"{self.prefix}.{e}.{proj}.{self.checkpoint_suffix(key)}"
            for e in range(layer.num_experts)
            for proj in ("gate_proj", "up_proj", "down_proj")
            for key in keys
            if ("w2" if proj == "down_proj" else "w13", e, proj, key) not in self._seen
        ]
        if missing:
            raise ValueError(
                f"the checkpoint lacks routed-expert tensors: {missing[0]}"
                + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else "")
            )
        for part, (n, k) in self.shapes(layer).items():
            stack = self._stacks.pop(part)
            stacks = self._build_stacks(
                part,
                layer.num_experts,
                n,
                k,
                self.device,
                lambda e, s=stack, p=part: self._expert(s, e, p),
            )
            self._register(layer, part, stacks)
        self._use(layer, kernels)

    def _expert(self, stack: dict[str, torch.Tensor], e: int, part: str) -> formats.QuantWeights:
        """Expert e's stacked checkpoint values as the scheme's tensors."""
        try:
            return self._convert(stack, e)
        except ValueError as exc:
            raise ValueError(f"{self.prefix}.{e} ({part}): {exc}") from None

    def _convert(self, stack: dict[str, torch.Tensor], e: int) -> formats.QuantWeights:
        values, scale = stack["values"][e], stack["scale"][e]
        scheme = self.spec.scheme
        if scheme == "fp8_w8a16":
            return formats.from_fp8_values(values, scale if self.group else scale[:, 0], self.group)
        if scheme in formats.INT4_SCHEMES:  # signed [-8, 7] here, unsigned [0, 15] there
            zero = stack.get("zero")
            return formats.from_int4_values(
                (values.to(torch.int16) + 8).to(torch.uint8),
                scale,
                None if zero is None else zero[e].to(torch.float32) + 8,
                self.spec.group_size,
                scheme,
            )
        return formats.from_int8_values(values, scale[:, 0], scheme)


def _expect_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {list(tensor.shape)}; expected {list(shape)}")
