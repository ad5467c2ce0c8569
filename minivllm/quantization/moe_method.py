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
the linear layers. A token batch reads each chosen expert's rows once.
"""

from __future__ import annotations

import dataclasses
import logging

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
        self.experts: dict[str, list[QuantizedLinearMethod]] = {p: [] for p in PARTS}

    @property
    def group(self) -> int:
        """k per scale column: int4's group, else 0 (per channel)."""
        return self.spec.group_size if self.spec.scheme in formats.INT4_SCHEMES else 0

    def shapes(self, layer: nn.Module) -> dict[str, tuple[int, int]]:
        """Each stacked part as one matrix: [E * rows, k]."""
        e, hidden, inter = layer.num_experts, layer.hidden_size, layer.intermediate
        return {"w13": (e * 2 * inter, hidden), "w2": (e * hidden, inter)}

    def process_weights_after_loading(self, layer: nn.Module, kernels: Kernels) -> None:
        shapes = self.shapes(layer)
        for part in PARTS:
            full = getattr(layer, part).data
            k = shapes[part][1]
            if self.spec.scheme in formats.INT4_SCHEMES and k % self.spec.group_size:
                raise ValueError(
                    f"routed experts' {part} has {k} input features per rank, which int4 "
                    f"groups of {self.spec.group_size} do not divide; pass a group_size "
                    "that does (quantization_config={'group_size': ...})"
                )
            qw = formats.quantize(
                full.reshape(shapes[part]),
                self.spec.scheme,
                self.spec.group_size,
                self.spec.symmetric,
            )
            delattr(layer, part)
            self._register(layer, part, qw)
        self._use(layer, kernels)

    def _register(self, layer: nn.Module, part: str, qw: formats.QuantWeights) -> None:
        """`qw`'s tensors on huge pages, as the layer's `{part}_{name}` parameters."""
        arena = huge_pages.weights_arena()
        for name, tensor in qw.tensors().items():
            param = nn.Parameter(arena.copy(tensor), requires_grad=False)
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
                method.use(view, kernels)
                self.experts[part].append(method)

    @property
    def op_name(self) -> str:
        return self.experts["w13"][0].op_name

    @property
    def quant_weights(self) -> formats.QuantWeights | None:
        """Expert 0's w13 (what the backend log describes)."""
        return self.experts["w13"][0].quant_weights if self.experts["w13"] else None

    @property
    def kernel_op(self):
        return self.experts["w13"][0].kernel_op

    def apply(
        self, layer: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        w13, w2 = self.experts["w13"], self.experts["w2"]
        return routed_experts(
            x,
            weights,
            ids,
            lambda e, rows: w13[e].apply(layer, rows, None),
            lambda e, h: w2[e].apply(layer, h, None),
        )

    def dequantized(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) as the model-dtype stacks the reference would hold: for tests and
        for callers that want the experts' effective weights."""
        out = []
        for part in PARTS:
            rows = torch.cat([formats.dequantize(m.quant_weights) for m in self.experts[part]])
            n, k = self.shapes(layer)[part]
            out.append(rows.view(layer.num_experts, n // layer.num_experts, k))
        return out[0], out[1]


class CheckpointMoEMethod(QuantizedMoEMethod):
    """Routed experts the checkpoint stores quantized, one tensor per expert and projection
    (`experts.7.up_proj.weight`, `...weight_scale_inv`): DeepSeek's fp8 releases
    (transformers' fp8 format, 128 x 128 block scales) and compressed-tensors checkpoints
    (int8 per channel, int4 groups packed or not, fp8 per channel, tensor or block).

    The model's loader hands each expert tensor to `load_expert_tensor`, which brings it
    to rows (a per-tensor or block scale repeated down the rows, packed words unpacked),
    cuts this rank's part (gate and up: rows of the intermediate dimension; down: its
    columns, and their groups), and writes it into a stack [E, rows, k]. After loading,
    the stacks become the scheme's tensors as `formats.from_*_values` build them for a
    pre-quantized linear: the checkpoint's values and scales, never re-quantized."""

    def __init__(self, stored, backend: str | None = None) -> None:
        super().__init__(stored.spec, backend, stored.format)
        self.stored = stored
        self.block = stored.block
        self._stacks: dict[str, dict[str, torch.Tensor]] = {}
        self._seen: set[tuple[str, int, str, str]] = set()

    @property
    def group(self) -> int:
        """k per scale column: int4's group, block fp8's block k, else 0 (per channel)."""
        if self.block is not None:
            return self.block[1]
        return self.spec.group_size if self.spec.scheme in formats.INT4_SCHEMES else 0

    def create_weights(self, layer: nn.Module) -> None:
        """Drop w13 and w2: the checkpoint format's stacks replace them as tensors arrive
        (`_stack`; never allocated where the weight cache maps the processed tensors)."""
        group = self.group
        for part, (_, k) in self.shapes(layer).items():
            if group and k % group:
                hint = " (a smaller tensor_parallel_size may)" if layer.tp_size > 1 else ""
                raise ValueError(
                    f"the checkpoint's routed experts hold a scale per {group} k, which does "
                    f"not divide their {part} input of {k} features on this rank{hint}"
                )
            delattr(layer, part)

    @property
    def asymmetric(self) -> bool:
        return self.spec.scheme in formats.INT4_SCHEMES and not self.spec.symmetric

    def _stack(self, layer: nn.Module, part: str) -> dict[str, torch.Tensor]:
        """The part's values [E, rows, k], scales [E, rows, k / group or 1] (NaN until
        loaded) and int4 zero points, allocated at its first tensor."""
        if part not in self._stacks:
            n, k = self.shapes(layer)[part]
            e, group = layer.num_experts, self.group
            integer = self.spec.scheme != "fp8_w8a16"
            cols = k // group if group else 1
            self._stacks[part] = {
                "values": torch.zeros(e, n // e, k, dtype=torch.int8 if integer else torch.uint8),
                "scale": torch.full((e, n // e, cols), float("nan")),
                **(
                    {"zero": torch.zeros(e, n // e, cols, dtype=torch.int8)}
                    if self.asymmetric
                    else {}
                ),
            }
        return self._stacks[part]

    def load_expert_tensor(
        self, layer: nn.Module, expert: int, proj: str, suffix: str, tensor: torch.Tensor
    ) -> None:
        """One checkpoint tensor of expert `expert`'s `proj` (gate_proj, up_proj, down_proj)."""
        from minivllm.quantization.ct_method import _scale_values, unpack_int32

        name = f"experts.{expert}.{proj}.{suffix}"
        part = "w2" if proj == "down_proj" else "w13"
        stack = self._stack(layer, part)
        inter, hidden = layer.intermediate * layer.tp_size, layer.hidden_size
        full_rows, full_k = (hidden, inter) if part == "w2" else (inter, hidden)
        group = self.group
        if suffix in ("input_scale", "activation_scale", "weight_shape"):
            return  # static activation scales: read, not used (weight-only); shape: a record
        if suffix in ("weight", "weight_packed"):
            if suffix != ("weight_packed" if self.stored.format == "pack-quantized" else "weight"):
                raise ValueError(
                    f"{name}: the checkpoint's {self.stored.format} format has no {suffix}"
                )
            if tensor.dtype == torch.int32:
                tensor = unpack_int32(
                    tensor, 4 if self.spec.scheme in formats.INT4_SCHEMES else 8, full_k
                )
            elif tensor.dtype == torch.float8_e4m3fn:
                tensor = tensor.view(torch.uint8)
            want = stack["values"].dtype
            if tensor.dtype != want:
                raise ValueError(f"{name} is {tensor.dtype}; the checkpoint's scheme stores {want}")
            value = tensor
        elif suffix == self.stored.scale_name or (
            # transformers' per-tensor fp8 names its scale either way
            self.stored.per_tensor and suffix in ("weight_scale", "weight_scale_inv")
        ):
            value = _scale_values(tensor)
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
            suffix = "scale"
        elif suffix == "weight_zero_point" and "zero" in stack:
            if tensor.dtype == torch.int32:  # packed down the rows
                tensor = unpack_int32(tensor.t().contiguous(), 4, full_rows).t().contiguous()
            value, suffix = tensor, "zero"
        else:
            raise ValueError(f"unexpected routed-expert tensor {name} for {self.stored}")
        key = "values" if suffix in ("weight", "weight_packed") else suffix
        columns = full_k if key == "values" else (full_k // group if group else 1)
        if tuple(value.shape) != (full_rows, columns):
            raise ValueError(
                f"{name} has shape {tuple(value.shape)}; expected {[full_rows, columns]} for "
                f"{layer.num_experts} experts of intermediate size {inter}"
            )
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
            f"experts.{e}.{proj}.{key}"
            for e in range(layer.num_experts)
            for proj in ("gate_proj", "up_proj", "down_proj")
            for key in keys
            if ("w2" if proj == "down_proj" else "w13", e, proj, key) not in self._seen
        ]
        if missing:
            raise ValueError(
                f"the checkpoint lacks routed-expert tensors: {missing[0]}"
                + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else "")
                + f" (values, scale{', zero point' if len(keys) > 2 else ''} per projection)"
            )
        for part in PARTS:
            stack = self._stacks[part]
            e, rows, k = stack["values"].shape
            values = stack["values"].reshape(e * rows, k)
            scale = stack["scale"].reshape(e * rows, -1)
            scheme = self.spec.scheme
            if scheme == "fp8_w8a16":
                qw = formats.from_fp8_values(
                    values, scale if self.group else scale[:, 0], self.group
                )
            elif scheme in formats.INT4_SCHEMES:  # signed [-8, 7] here, unsigned [0, 15] there
                zero = stack.get("zero")
                qw = formats.from_int4_values(
                    (values.to(torch.int16) + 8).to(torch.uint8),
                    scale,
                    None if zero is None else zero.reshape(e * rows, -1).to(torch.float32) + 8,
                    self.spec.group_size,
                    scheme,
                )
            else:
                qw = formats.from_int8_values(values, scale[:, 0], scheme)
            self._register(layer, part, qw)
        self._stacks = {}
        self._use(layer, kernels)
